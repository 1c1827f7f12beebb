"""torch.compile against eager: one inductor compile of the tiniest network's training graph (tens of seconds on
two cores, so once per module) and one of a small dropout function, for the masks the compiled backward recomputes;
and the cheap 'aot_eager' backend (the same captured graphs, eager kernels) for state-dict names, resume across
compile on and off, and the compiled sampler."""

import copy
import functools
import os

import pytest
import torch
import torch._inductor.config
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import saved_tensors_hooks
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

from edm2.encoders import StandardRGBEncoder
from edm2.layers import force_weight_normalization
from edm2.loss import EDM2Loss
from edm2.networks import Precond
from edm2.procedures.generation import generate_images
from edm2.runtime import speed
from edm2.runtime.inductor_options import RecomputeCPUMasks, training_options
from training import step as step_module
from training.run.benchmark import synthetic_step
from training.state import adam
from training.step import training_step
from tests.helpers import randomized, tiny_precond

CPU = torch.device("cpu")


def tiniest(seed=0, resolution=4, channels=8):
    """The smallest U-Net with every kind of block: one level, one block, attention in the decoder's first."""
    torch.manual_seed(seed)
    net = Precond(resolution, 2, 2, model_channels=channels, channel_mult=[1], num_blocks=1, attn_resolutions=[],
                  channels_per_head=8, logvar_channels=8)
    return randomized(net, seed).train()


def loss_step(net, loss_fn, seed):
    """Loss, gradients and the parameters after one Adam step (lr 0.01) of the summed loss on a fixed batch."""
    optimizer = adam(net.parameters(), CPU)
    optimizer.param_groups[0]["lr"] = 0.01
    shape = (3, net.img_channels, net.img_resolution, net.img_resolution)
    images, labels = torch.randn(shape, generator=torch.Generator().manual_seed(7)), torch.eye(2)[[0, 1, 1]]
    torch.manual_seed(seed)  # the loss draws its noise levels and noise from the global generator
    force_weight_normalization(net)  # as the training step does before every forward pass
    loss = loss_fn(net, images, labels)
    loss.sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    optimizer.step()
    return loss.detach(), grads, [p.detach().clone() for p in net.parameters()]


def inductor_vector_width() -> dict:
    """Inductor settings that keep its own choice of vector instructions when ATEN_CPU_CAPABILITY forces eager
    onto other kernels (the suite's cross-kernel check): with 'default' inductor turns vectorization off, and
    the C++ that torch 2.13 then generates for this graph does not compile (it still calls at::vec)."""
    if os.environ.get("ATEN_CPU_CAPABILITY") != "default":
        return {}
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list
    isas = valid_vec_isa_list()
    return {"cpp.simdlen": isas[0].bit_width()} if isas else {}


@pytest.fixture(scope="module")
def inductor_vs_eager():
    # 8x8 with 16 channels, not the tiniest 4x4 with 8: torch 2.13's AVX2 code for the latter's 16-pixel,
    # one-head attention tiles computes NaN in the fused loss (ATEN_CPU_CAPABILITY=avx2; AVX-512 is right).
    eager = loss_step(tiniest(resolution=8, channels=16), EDM2Loss(), seed=3)
    saved_dtypes = []  # of every tensor the compiled graph keeps for its backward pass

    def pack(tensor):
        saved_dtypes.append(tensor.dtype)
        return tensor

    with torch._inductor.config.patch(inductor_vector_width()), saved_tensors_hooks(pack, lambda tensor: tensor):
        compiled, codes = run_and_get_code(loss_step, tiniest(resolution=8, channels=16),
                                           speed.compile_loss(EDM2Loss(), CPU), seed=3)
    return eager, compiled, saved_dtypes, codes


def test_inductor_loss_gradients_and_adam_step_match_eager(inductor_vs_eager):
    (loss, grads, params), (loss_c, grads_c, params_c), _, _ = inductor_vs_eager
    # Inductor fuses the elementwise chains and reorders reductions (weight norms, pixel norms, softmax); every
    # float32 operation rounds with relative error eps = 1.2e-7, and a path through this network has about 40
    # operations, so outputs agree to ~40 eps = 5e-6 relative: rtol 2e-5. The same noise was drawn (outside the
    # graph), so the losses are comparable element by element.
    torch.testing.assert_close(loss_c, loss, rtol=2e-5, atol=2e-5 * loss.abs().max().item())
    for g_c, g in zip(grads_c, grads):
        # Gradients add up to 3 images x 16 pixels of such terms per weight; where they cancel, the error is
        # relative to the largest term, hence the absolute part from the tensor's largest gradient.
        torch.testing.assert_close(g_c, g, rtol=1e-4, atol=1e-4 * g.abs().max().item())
    for p_c, p, g in zip(params_c, params, grads):
        # Adam's first step moves each weight by lr g / (|g| + eps) = lr sign(g), up to eps / |g|: the same move
        # wherever the gradients agree in sign, which is everywhere outside the round-off band around 0.
        clear = g.abs() > 1e-4 * g.abs().max()
        torch.testing.assert_close(p_c[clear], p[clear], rtol=1e-6, atol=1e-6)
        assert ((p_c - p).abs() <= 2 * 0.01 + 1e-6).all()


def test_the_compiled_step_recomputes_its_masks_instead_of_saving_them(inductor_vs_eager):
    # The clamps' and norms' gradient masks: torch 2.13's CPU code moves booleans element by element, so the
    # compiled graph keeps the activations (bf16 or float32) and compares them again in its backward kernels.
    saved_dtypes = inductor_vs_eager[2]
    assert saved_dtypes and torch.bool not in saved_dtypes


def test_the_compiled_step_runs_its_kernels_from_cpp_on_the_cpu(inductor_vs_eager):
    # The forward and the backward graph each call their kernels from inductor's C++ wrapper, not from Python.
    codes = inductor_vs_eager[3]
    assert len(codes) == 2 and all("CppWrapperCodeCache" in code for code in codes)


def test_sampling_networks_compile_with_the_cpp_wrapper_on_the_cpu_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda net, **kwargs: calls.append(kwargs))
    speed.compile_network(tiniest(), CPU)
    speed.compile_network(tiniest(), torch.device("cuda"))  # only its options are asked for: no GPU needed
    assert calls[0]["options"] == {"cpp_wrapper": True} and not calls[1]["options"]


def test_a_recomputed_dropout_mask_is_the_one_the_forward_pass_drew():
    # A random mask must come back from the random values the forward pass drew, never from a second draw:
    # the partitioner saves the (unrecomputable) random tensor and compares it again.
    def dropped(x):
        y = torch.nn.functional.dropout(x, p=0.5, training=True)
        return y, (3 * y).clamp(-1, 1).sum()

    x = torch.randn(64, 64, requires_grad=True)
    with torch._inductor.config.patch(inductor_vector_width()):
        compiled = torch.compile(dropped, options=training_options(CPU))  # compile_loss's
        y, loss = compiled(x)
        loss.backward()
    # d loss / dx = 3 / (1 - p) where the element was kept and 3 y within the clamp, else 0.
    assert 0.3 < (y != 0).float().mean() < 0.7
    assert torch.equal(x.grad, 6.0 * ((y != 0) & ((3 * y).abs() <= 1)).float())


def test_only_cpu_boolean_values_are_tagged_for_recomputation():
    graph = make_fx(lambda x: (x.clamp(-1, 1), x >= 0))(torch.randn(3)).graph
    RecomputeCPUMasks()(graph)
    tags = {node.name: node.meta.get("recompute") for node in graph.nodes}
    assert tags["ge"] == CheckpointPolicy.MUST_RECOMPUTE and tags["clamp"] is None and tags["x_1"] is None
    compare = next(node for node in graph.nodes if node.name == "ge")
    del compare.meta["recompute"]
    with FakeTensorMode():
        compare.meta["val"] = torch.empty(3, dtype=torch.bool, device="cuda")  # CUDA's kernels handle booleans
    RecomputeCPUMasks()(graph)
    assert "recompute" not in compare.meta


def test_the_compiled_optimizer_step_is_adams_from_any_learning_rate_without_recompiling():
    nets = [tiniest(seed=1), tiniest(seed=1)]
    optimizers = [adam(net.parameters(), CPU) for net in nets]
    updates = [step_module.optimizer_step, step_module.compile_optimizer_step(CPU)]
    rates = (0.01, 0.02, 0.005, 0.01)  # the first step creates Adam's state eagerly, the second compiles
    largest_gradient = 0.0
    torch._dynamo.utils.counters.clear()
    for i, lr in enumerate(rates):
        for net, optimizer, update in zip(nets, optimizers, updates):
            generator = torch.Generator().manual_seed(i)
            for param in net.parameters():
                param.grad = torch.randn(param.shape, generator=generator)
            largest = max(net.parameters(), key=torch.numel)
            largest_gradient = max([largest_gradient, *(param.grad.abs().max().item() for param in net.parameters())])
            largest.grad.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])  # zeroed first
            with torch._dynamo.config.patch(error_on_recompile=i >= 2):
                update(net, optimizer, lr)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # compiled once, whatever the rate
    eps, steps = torch.finfo(torch.float32).eps, len(rates)
    for p_c, p in zip(nets[1].parameters(), nets[0].parameters()):
        assert p_c.grad is None and p.grad is None
        # Adam moves a weight by lr m / (sqrt(v) + eps), with |m| / sqrt(v) below 2.4 for betas 0.9 and 0.99; the
        # graph rounds that update in other steps (capturable Adam: six roundings, bias corrections in float32), so
        # per step the two differ by about 6 eps x 2.4 lr, and the weight's sum may round 1 ulp apart.
        atol = steps * (16 * eps * max(rates) + eps * p.abs().max().item())
        torch.testing.assert_close(p_c, p, rtol=0, atol=atol)
    states = [optimizer.state_dict() for optimizer in optimizers]
    assert states[1]["param_groups"] == states[0]["param_groups"]  # the learning rate recorded as a float
    for s_c, s in zip(states[1]["state"].values(), states[0]["state"].values()):
        assert s_c.keys() == s.keys() and torch.equal(s_c["step"], s["step"])
        # m sums decayed gradients, which cancel: its error is relative to the largest gradient, one rounding or
        # two a step; v sums squares, which do not cancel: relative to itself.
        torch.testing.assert_close(s_c["exp_avg"], s["exp_avg"], rtol=0, atol=steps * 2 * eps * largest_gradient)
        torch.testing.assert_close(s_c["exp_avg_sq"], s["exp_avg_sq"], rtol=steps * 3 * eps, atol=0)


def test_runs_compile_their_optimizer_step_on_the_cpu_only():
    eager = step_module.optimizer_step
    assert synthetic_step("toy-tiny", 4, CPU, resolution=8, compile=False).update is eager
    compiled = synthetic_step("toy-tiny", 4, CPU, resolution=8, compile=True)
    assert compiled.update is not eager
    assert step_module.training_update(compiled.opts, torch.device("cuda")) is eager  # CUDA's Adam: one fused kernel


@pytest.fixture
def aot_eager(monkeypatch):
    """Make the training and sampling setup compile with the 'aot_eager' backend, and Adam run eagerly (the compiled
    optimizer step rounds its bias corrections in float32, eager Adam in Python doubles)."""
    monkeypatch.setattr(step_module, "compile_loss", functools.partial(speed.compile_loss, backend="aot_eager"))
    monkeypatch.setattr(step_module, "compile_optimizer_step", lambda device: step_module.optimizer_step)
    monkeypatch.setattr(speed, "compile_network", functools.partial(speed.compile_network, backend="aot_eager"))


def run_steps(compile, saved=None, steps=2):
    step = synthetic_step("toy-tiny", 4, CPU, resolution=8, compile=compile)
    if saved is not None:
        step.state.load(copy.deepcopy(saved))  # Adam adopts same-device tensors as they are, and would step them
    for _ in range(steps):
        training_step(step)
    return step.state.to_dict()


# aot_eager's graphs round as eager does from PyTorch 2.11 (2.8's differed by up to 7e-7 after two steps of this test).
AOT_EAGER_BITWISE = torch.__version__ >= "2.11"  # a TorchVersion: compared as a version, not as text


@pytest.mark.skipif(not AOT_EAGER_BITWISE, reason="aot_eager matches eager bit for bit from PyTorch 2.11")
def test_compiled_and_eager_runs_resume_each_other(aot_eager):
    saved_eager, saved_compiled = run_steps(compile=False), run_steps(compile=True)
    # The same names: compiling the loss leaves the network and its state dict as they are.
    assert list(saved_compiled["net"]) == list(saved_eager["net"])
    assert not any("_orig_mod" in k for k in saved_eager["net"])
    reference = run_steps(compile=False, saved=saved_eager)  # eager all along
    # aot_eager runs the captured graphs with eager kernels: whichever way a run switches, it continues bit for bit.
    for first, then in ((saved_eager, True), (saved_compiled, False), (saved_compiled, True)):
        saved = run_steps(compile=then, saved=first)
        assert all(torch.equal(saved["net"][k], v) for k, v in reference["net"].items())
        for ema, ema_ref in zip(saved["ema"]["emas"], reference["ema"]["emas"]):
            assert all(torch.equal(ema[k], v) for k, v in ema_ref.items())


def test_compiled_sampling_network_keeps_its_names_and_images(aot_eager):
    net = randomized(tiny_precond(img_resolution=8, label_dim=4)).eval().requires_grad_(False)
    names = list(net.state_dict())
    eager = [images for _, images, _ in generate_images(net, StandardRGBEncoder(), range(3), batch_size=2, device=CPU,
                                                     num_steps=3)]
    speed.SamplingSpeed(compile=True).apply(net, CPU)
    assert net._compiled_call_impl is not None and list(net.state_dict()) == names
    compiled = [images for _, images, _ in generate_images(net, StandardRGBEncoder(), range(3), batch_size=2, device=CPU,
                                                        num_steps=3)]
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))  # uint8 images of the same computation


def test_a_compiled_network_in_training_mode_computes_with_the_forced_weights_and_writes_none(aot_eager):
    eager, compiled = tiniest(), speed.compile_network(tiniest(), CPU)
    images, sigma, labels = torch.randn(3, 2, 4, 4), torch.tensor([0.5, 1.0, 2.0]), torch.eye(2)[[0, 1, 1]]
    initial = [p.detach().clone() for p in eager.parameters()]
    for net in (eager, compiled):
        force_weight_normalization(net)  # the training step's Eq. 66, the same call for both
    forced = [p.detach().clone() for p in eager.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(forced, initial))
    # With u(sigma) as training computes it: every layer, logvar_linear included.
    want = eager(images, sigma, labels, return_logvar=True)
    got = compiled(images, sigma, labels, return_logvar=True)
    # Neither forward pass wrote the weights, and the graph computed with the normalized ones.
    assert all(torch.equal(a, b) for a, b in zip(compiled.parameters(), forced))
    assert all(torch.equal(a, b) for a, b in zip(eager.parameters(), forced))
    assert all(torch.equal(a, b) for a, b in zip(got, want))