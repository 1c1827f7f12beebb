"""Check TorchScript's serialized code (Python-syntax text) against the allowlist of tensor arithmetic.

Used by edm2/safe_torchscript.py, which explains why detector files are checked rather than re-implemented.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize

import torch

from edm2 import torchscript_allowlist as allow
from edm2.errors import EDM2Error

# Roots of qualified names: TorchScript's operator namespaces, the archive's own code, its tensor constants.
_ROOTS = ("torch", "ops", "__torch__", "CONSTANTS")
_RESERVED = frozenset(_ROOTS) | allow.BUILTIN_CALLS | allow.TYPE_NAMES | allow.GENERIC_TYPES
# ops.NAMESPACE.NAME(...): the operators each namespace may call.
_OPS_NAMESPACES = {"aten": allow.ATEN_OPS, "prim": allow.PRIM_OPS}
_SIMPLE_STRING = re.compile(r"""("[^"\\\n]*(\\.[^"\\\n]*)*"|'[^'\\\n]*(\\.[^'\\\n]*)*')""")


class UnsafeTorchScript(EDM2Error):
    """A TorchScript file that is not a ZIP archive of tensor arithmetic; the message says what was found."""


class _Definitions:
    """What the archive's code defines: qualified classes and functions, and member names of its classes."""

    def __init__(self, modules: dict[str, ast.Module]):
        self.classes: set[str] = set()
        self.functions: set[str] = set()
        self.members: set[str] = set()
        for module, tree in modules.items():
            for node in tree.body:
                if isinstance(node, ast.FunctionDef):
                    self.functions.add(f"{module}.{node.name}")
                elif isinstance(node, ast.ClassDef):
                    self.classes.add(f"{module}.{node.name}")
                    self.members |= {_member_name(item) for item in node.body} - {None}


def _member_name(node: ast.stmt) -> str | None:
    """The attribute or method a class-body statement declares ('x : T', '__annotations__["0"] = T', 'def f')."""
    if isinstance(node, ast.FunctionDef):
        return node.name
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Subscript):
        key = node.targets[0].slice
        return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None
    return None


def _dotted(node: ast.expr) -> str | None:
    """'a.b.c' for an attribute chain that starts at a plain name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _stored_names(nodes: list[ast.stmt]) -> set[str]:
    """Every plain name a function body assigns."""
    return {n.id for stmt in nodes for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


class _CodeChecker:
    """Walks one code file's syntax tree; refuses the first statement, operator or name not on the allowlist."""

    def __init__(self, where: str, definitions: _Definitions):
        self.where, self.defs = where, definitions

    def refuse(self, node: ast.AST, what: str) -> None:
        raise UnsafeTorchScript(f"{self.where} line {getattr(node, 'lineno', '?')} uses {what}, which is not on "
                                "the allowlist of tensor arithmetic")

    def module(self, tree: ast.Module) -> None:
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                self.class_def(node)
            elif isinstance(node, ast.FunctionDef):
                self.function(node)
            elif isinstance(node, ast.Import) and all(a.name.startswith("__torch__.") and a.asname is None
                                                      for a in node.names):
                continue  # older archives import their own modules
            elif not (isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "op_version_set"
                      and isinstance(node.value, ast.Constant) and type(node.value.value) is int):
                self.refuse(node, f"the top-level statement '{ast.unparse(node)[:60]}'")

    def class_def(self, node: ast.ClassDef) -> None:
        if node.decorator_list or node.keywords or [ast.unparse(b) for b in node.bases] != ["Module"]:
            self.refuse(node, f"class {node.name} that is not a plain Module")
        for item in node.body:
            if isinstance(item, ast.FunctionDef):
                self.function(item)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                self.type(item.annotation)
                if item.value is not None:
                    self.constant(item.value)
            elif (isinstance(item, ast.Assign) and len(item.targets) == 1 and isinstance(item.targets[0], ast.Name)
                  and item.targets[0].id in allow.CLASS_LISTS):
                self.constant(item.value)
            elif (isinstance(item, ast.Assign) and len(item.targets) == 1 and _member_name(item) is not None
                  and ast.unparse(item.targets[0].value) == "__annotations__"):
                self.type(item.value)
            else:
                self.refuse(item, f"the class-body statement '{ast.unparse(item)[:60]}'")

    def constant(self, node: ast.expr) -> None:
        if isinstance(node, (ast.Tuple, ast.List)):
            for element in node.elts:
                self.constant(element)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            self.constant(node.operand)
        elif not isinstance(node, ast.Constant):
            self.refuse(node, f"'{ast.unparse(node)[:60]}' where a constant belongs")

    def function(self, node: ast.FunctionDef) -> None:
        args = node.args
        if node.decorator_list or args.vararg or args.kwarg:
            self.refuse(node, f"a decorated or variadic function {node.name}")
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        for param in params:
            if param.annotation is not None:
                self.type(param.annotation)
        for default in [*args.defaults, *[d for d in args.kw_defaults if d is not None]]:
            self.expr(default, set())
        if node.returns is not None:
            self.type(node.returns)
        scope = {p.arg for p in params} | _stored_names(node.body)
        for name in scope & _RESERVED:
            self.refuse(node, f"the reserved name '{name}' as a variable")
        self.block(node.body, scope)

    def block(self, body: list[ast.stmt], scope: set[str]) -> None:
        for node in body:
            self.statement(node, scope)

    def statement(self, node: ast.stmt, scope: set[str]) -> None:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                self.expr(target, scope)
            self.expr(node.value, scope)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            self.expr(node.target, scope)
            if isinstance(node, ast.AnnAssign):
                self.type(node.annotation)
            if node.value is not None:
                self.expr(node.value, scope)
        elif isinstance(node, (ast.Expr, ast.Return)):
            if node.value is not None:
                self.expr(node.value, scope)
        elif isinstance(node, (ast.If, ast.While, ast.For)):
            for part in ((node.target, node.iter) if isinstance(node, ast.For) else (node.test,)):
                self.expr(part, scope)
            self.block(node.body + node.orelse, scope)
        elif not isinstance(node, (ast.Pass, ast.Break, ast.Continue)):
            self.refuse(node, f"the statement '{ast.unparse(node)[:60]}'")

    def expr(self, node: ast.expr, scope: set[str]) -> None:
        if isinstance(node, ast.Constant):
            return
        if isinstance(node, ast.Name):
            if node.id not in scope:
                self.refuse(node, f"the name '{node.id}'")
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted is not None and dotted.split(".")[0] in _ROOTS:
                self.qualified(node, dotted)
            else:
                self.member(node, node.attr)
                self.expr(node.value, scope)
        elif isinstance(node, ast.Call):
            self.call(node, scope)
        elif isinstance(node, (ast.List, ast.Tuple)):
            for element in node.elts:
                self.expr(element, scope)
        elif isinstance(node, (ast.BinOp, ast.BoolOp, ast.Compare, ast.UnaryOp, ast.IfExp, ast.Subscript,
                               ast.Slice)):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self.expr(child, scope)
        else:
            self.refuse(node, f"the expression '{ast.unparse(node)[:60]}'")

    def call(self, node: ast.Call, scope: set[str]) -> None:
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            self.refuse(node, "argument unpacking")
        args = list(node.args)
        func = node.func
        if isinstance(func, ast.Name) and func.id not in scope:
            if func.id not in allow.BUILTIN_CALLS:
                self.refuse(node, f"the function '{func.id}'")
            if func.id == "getattr":  # only a literal member name: no strings built at run time
                if len(args) != 2 or node.keywords or not isinstance(args[1], ast.Constant):
                    self.refuse(node, "getattr with a computed name")
                self.member(node, str(args[1].value))
                args = args[:1]
            elif func.id in allow.TYPE_ARGUMENT_CALLS and args:
                type_arg = args.pop(1 if func.id == "isinstance" and len(args) > 1 else 0)
                self.type(type_arg)
        else:
            self.expr(func, scope)
            if _dotted(func) == "ops.prim.RaiseException" and len(args) > 1 and not (
                    isinstance(args[1], ast.Constant) and re.fullmatch(r"builtins\.\w+", str(args[1].value))):
                self.refuse(node, "an exception class outside Python's builtins")
        for arg in [*args, *(k.value for k in node.keywords)]:
            self.expr(arg, scope)

    def qualified(self, node: ast.expr, dotted: str) -> None:
        parts = dotted.split(".")
        root, rest = parts[0], parts[1:]
        if root == "torch" and len(rest) == 1 and rest[0] in allow.ATEN_OPS:
            return
        if root == "ops" and len(rest) == 2 and rest[1] in _OPS_NAMESPACES.get(rest[0], ()):
            return
        if root == "__torch__" and dotted in self.defs.classes | self.defs.functions:
            return
        if root == "CONSTANTS" and len(rest) == 1 and re.fullmatch(r"c\d+", rest[0]):
            return
        self.refuse(node, f"'{dotted}'")

    def member(self, node: ast.AST, name: str) -> None:
        """x.name: a listed tensor operator or property, or a member the archive's classes declare that is not
        also one of the tensor's own (unlisted) methods such as storage()."""
        if name in allow.ATEN_OPS or name in allow.TENSOR_PROPERTIES:
            return
        if name not in self.defs.members or hasattr(torch.Tensor, name):
            self.refuse(node, f"the attribute '.{name}'")

    def type(self, node: ast.expr) -> None:
        if isinstance(node, ast.Constant) and node.value is None:
            return
        if isinstance(node, ast.Name) and node.id in allow.TYPE_NAMES:
            return
        if isinstance(node, ast.Attribute) and _dotted(node) in self.defs.classes:
            return
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in allow.GENERIC_TYPES:
            for arg in (node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]):
                self.type(arg)
            return
        if isinstance(node, ast.Tuple):  # isinstance(x, (A, B))
            for arg in node.elts:
                self.type(arg)
            return
        self.refuse(node, f"the type '{ast.unparse(node)[:60]}'")


def _parse_code(name: str, data: bytes) -> ast.Module:
    """Parse a code file whose text both Python and TorchScript read alike: ASCII, spaces, plain quoted strings."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise UnsafeTorchScript(f"{name} is not plain ASCII code") from None
    if re.search(r"[^\n\x20-\x7e]", text):
        raise UnsafeTorchScript(f"{name} holds control characters (tabs, carriage returns, ...)")
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.STRING and not _SIMPLE_STRING.fullmatch(token.string):
                raise UnsafeTorchScript(f"{name} line {token.start[0]} holds a string literal in a form TorchScript "
                                        f"may read differently: {token.string[:40]}")
        return ast.parse(text, filename=name)
    except (SyntaxError, tokenize.TokenError) as e:
        raise UnsafeTorchScript(f"{name} is not code TorchScript writes ({e})") from None


def check_code(files: dict[str, bytes]) -> set[str]:
    """Parse and check every code file ({'code/__torch__/a/b.py': text}); return the classes the code defines."""
    try:
        modules = {name[len("code/"):-len(".py")].replace("/", "."): _parse_code(name, text)
                   for name, text in files.items()}
        definitions = _Definitions(modules)
        for module, tree in modules.items():
            _CodeChecker(f"code/{module.replace('.', '/')}.py", definitions).module(tree)
    except RecursionError:
        raise UnsafeTorchScript("the archive's code nests deeper than any model's code") from None
    return definitions.classes
