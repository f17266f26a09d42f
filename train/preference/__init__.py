"""Preference tuning (train.method dpo, orpo, kto): each answer's log-probability from the hidden states (``logps``),
the methods' losses as TRL computes them (``objective``), the step over unequal shares (``step``), the reference's
log-probabilities kept per pair (``reference``) and the held-out pairs before and after (``evaluate``)."""
