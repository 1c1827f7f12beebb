"""What the command lines share and the library must not know: click option types and one-line errors."""
