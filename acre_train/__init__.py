"""acre-train: train, export, run and evaluate ACRE bi-layer KV adapters for long-context LLMs.

Layout (data -> model -> train -> export -> infer -> eval):

* ``acre_train.modeling``  the ACRE model: interleave plan, visibility rule and kernels, adapter
* ``acre_train.data``      corpus readers, span packing, QA/SFT builders (``acre-train preprocess``)
* ``acre_train.train``     recipes, trainer, DeepSpeed launch (``acre-train train``)
* ``acre_train.export``    inference-ready checkpoints (``acre-train export``)
* ``acre_train.infer``     bi-layer cache and query-guided refilling (``acre-train chat/generate``)
* ``acre_train.eval``      long-context QA harness (``acre-train eval``)
"""

__version__ = "0.1.0"
