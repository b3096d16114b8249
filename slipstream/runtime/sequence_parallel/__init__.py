"""DeepSpeed's ``deepspeed.runtime.sequence_parallel``: the Arctic Long Sequence Training (ALST)
entry points for Hugging Face models (:mod:`.ulysses_sp`) and their process groups
(:mod:`.parallel_state_sp`)."""
