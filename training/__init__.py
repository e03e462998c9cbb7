"""Multi-turn RL for the main policy: rewards, group advantages with turn-level credit, the clipped token-level loss.

The algorithmic core is three small modules that know nothing about rollouts or models beyond their arguments:
`rewards` (final and per-turn rewards as plain functions), `advantages` (group baselines and credit assignment,
pure Python) and `loss` (the masked, clipped policy-gradient loss in torch).
"""
