"""schedlab's command layer: one module per subcommand of ``schedlab`` (``schedlab.cli``'s
``COMMANDS`` names them), each a Typer app over the public API (``schedlab``'s functions and
option objects) with a ``main()``; ``_app`` is what they share (one-line errors, exit codes,
``-o key=value``). Nothing outside this package and ``schedlab.cli`` imports it."""
