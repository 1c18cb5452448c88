"""What each serving engine's scheduler lets an operator set: one declarative table of knobs per engine
(`vllm.py`), read through one reader (`knobs.py`) by the rules (which knob binds, in which direction), by `compare`
(which fix a changed knob applies) and by the docs. Nothing here reads a capture or a rule.
"""
