"""DeepSpeed's ``deepspeed.launcher`` package: the ``deepspeed`` command (:mod:`.runner`).

With ``SLIPSTREAM_AS_DEEPSPEED=1`` the ``deepspeed`` console script that a DeepSpeed install
left on ``PATH`` (``from deepspeed.launcher.runner import main``) runs slipstream's launcher,
``slipstream run``, with DeepSpeed's flags.
"""
