"""Long-context QA evaluation: tasks, metrics, methods (full, truncated, CacheFocus, InfoFlow and
its baselines) on one model, prompt and greedy decoding, and the harness that tabulates them."""

from .harness import EvalConfig, EvalReport, evaluate, markdown_table, summarize
from .methods import METHODS, parse_method, parse_methods
from .prompt import PreparedExample, prepare_example
from .examples import Example, load_jsonl, save_jsonl
from .tasks import build_task, resolve_tasks

__all__ = [
    "METHODS", "EvalConfig", "EvalReport", "Example", "PreparedExample", "build_task", "evaluate", "load_jsonl",
    "markdown_table", "parse_method", "parse_methods", "prepare_example", "resolve_tasks", "save_jsonl", "summarize",
]
