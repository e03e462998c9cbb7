"""The trainable main policy: the turn loop, its token bookkeeping, and the prompt/parse format it speaks."""
