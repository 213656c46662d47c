"""specpilot.eval: task suites, interleaved benchmarking of decoding methods, paired intervals and verdicts,
exact replay beside live, the cost-model check, reports.

    from specpilot.eval import load_suite, evaluate, write_report
    prompts = load_suite("heldout")
    result = evaluate(prompts, pair=pair, methods=["fixed", "ddd", "hf_assisted"], rounds="auto",
                      time_budget_s=600, decide=("ddd", "fixed"))
    write_report(result.results, result.meta, "eval_out", analysis=result.analysis())

`specpilot.eval.full.full_evaluation` adds the greedy trace, a re-measured latency profile, replay and the
cost-model checks around the same `evaluate` call (what `specpilot demo` runs).
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
