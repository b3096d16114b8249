"""The ``slipstream`` command: ``run`` (launcher), ``report`` (environment), ``demo``.

Entry point: :func:`slipstream.cli.main.main`. Nothing heavy is imported here, so
the launcher and `slipstream --help` only pay for what they use.
"""
