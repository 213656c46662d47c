"""specpilot.eval: task suites, interleaved benchmarking of decoding methods, metrics and reports.

    from specpilot.eval import load_suite, evaluate, write_report
    prompts = load_suite("heldout")
    result = evaluate(prompts, pair=pair, methods=["fixed", "ddd", "hf_assisted"])
    write_report(result.results, result.meta, "eval_out")
"""
from specpilot.eval.suites import Prompt, SuiteError, load_suite

__all__ = ["Prompt", "SuiteError", "load_suite", "evaluate", "write_report"]


def __getattr__(name: str):
    # the runner and report pull in torch, transformers and matplotlib: import them only when used
    if name == "evaluate":
        from specpilot.eval.runner import evaluate
        return evaluate
    if name == "write_report":
        from specpilot.eval.report import write_report
        return write_report
    raise AttributeError(f"module 'specpilot.eval' has no attribute {name!r}")
