"""The ``slipstream`` command: ``run`` (launcher), ``report`` (environment), ``demo``.

Entry point: :func:`slipstream.cli.main.main`. Nothing heavy is imported here, so
``python -m slipstream.cli._rank_entry`` stays cheap in every rank.
"""
