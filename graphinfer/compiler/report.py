"""Human-readable tables of pass reports, for the CLI and compile artifacts."""
from graphinfer.passes import PassReport


def pass_table(reports: list[PassReport]) -> str:
    lines = ["| pass | matches | nodes before -> after | max abs error | time (ms) |", "|---|---|---|---|---|"]
    for r in reports:
        err = "not checked" if r.max_abs_error is None else f"{r.max_abs_error:.3g}"
        lines.append(f"| {r.name} | {r.matches} | {r.nodes_before} -> {r.nodes_after} | {err} | {r.time_s * 1e3:.1f} |")
    declined = [f"- {r.name} declined: {reason}" for r in reports for reason in r.declined]
    return "\n".join(lines + declined)


def histogram_table(histogram: dict[str, int]) -> str:
    return "\n".join(["| node | count |", "|---|---|"] + [f"| {k} | {v} |" for k, v in histogram.items()])
