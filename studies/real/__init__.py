"""The real-base study (``acre-train reproduce real``): ACRE on Qwen2.5-Coder-0.5B-Instruct, on a CPU.

``streams`` builds the training inputs (text mix for stage 1, long-context QA for stage 2) from a
SQuAD file split by article, so evaluation articles are never trained on.
"""
