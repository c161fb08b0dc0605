"""``python -m handformer``: the command line (``handformer.cli``)."""

try:  # importing the package loads torch: a Ctrl-C that early is still one line, exit 130
    from handformer.cli import main
except KeyboardInterrupt:
    import sys

    print("handformer: interrupted", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
