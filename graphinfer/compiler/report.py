"""Human-readable tables of pass reports, for the CLI and compile artifacts."""
from graphinfer.passes import PassReport


def _num(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def _verdict(passed: bool | None) -> str:
    return "not checked" if passed is None else ("ok" if passed else "FAIL")


def pass_table(reports: list[PassReport]) -> str:
    """One row per pass (and, when checked, one for the whole pipeline against the unfused graph), the
    tolerances, then each pass's declines."""
    lines = ["| pass | matches | nodes before -> after | max abs error | max rel error | time (ms) | check |",
             "|---|---|---|---|---|---|---|"]
    for r in reports:
        lines.append(f"| {r.name} | {r.matches} | {r.nodes_before} -> {r.nodes_after} | {_num(r.max_abs_error)} | "
                     f"{_num(r.max_rel_error)} | {r.time_s * 1e3:.1f} | {_verdict(r.passed)} |")
    e2e = getattr(reports, "end_to_end", None)
    if e2e is not None:
        first, last = (reports[0].nodes_before, reports[-1].nodes_after) if reports else ("", "")
        lines.append(f"| end-to-end (fused vs unfused) | {sum(r.matches for r in reports)} | {first} -> {last} | "
                     f"{_num(e2e.max_abs_error)} | {_num(e2e.max_rel_error)} | "
                     f"{sum(r.time_s for r in reports) * 1e3:.1f} | {_verdict(e2e.passed)} |")
        lines.append(f"\ntolerances: atol {e2e.atol:.3g}, rtol {e2e.rtol:.3g}"
                     + (f" ({e2e.dtype} outputs)" if e2e.dtype else "")
                     + "; a check passes when max abs error <= atol or max rel error <= rtol, with no NaN/inf "
                       "disagreement")
    problems = [f"- {r.name}: {r.check.why()}" for r in reports if r.check is not None and not r.check.passed]
    if e2e is not None and not e2e.passed:
        problems.append(f"- end-to-end: {e2e.why()}")
    declined = [f"- {r.name} declined: {reason}" for r in reports for reason in r.declined]
    return "\n".join(lines + (["", "failed checks:", *problems] if problems else []) + declined)


def histogram_table(histogram: dict[str, int]) -> str:
    return "\n".join(["| node | count |", "|---|---|"] + [f"| {k} | {v} |" for k, v in histogram.items()])
