"""The demo's default table and verdict (``evaluation/demo.py``): the verdict says what the table's tok/s show."""

from specfit.evaluation.demo import narrow_table, table_verdict

ROWS = [dict(method="ar", label="AR", tok_s=100.0, tokens_per_cycle=1.0, copies_per_token=9.0),
        dict(method="eagle3", label="EAGLE-3", tok_s=90.0, tokens_per_cycle=3.2, copies_per_token=12.0),
        dict(method="specfit", label="SpecFit + cache", tok_s=95.0, tokens_per_cycle=2.1, copies_per_token=9.5)]


def test_the_verdict_reads_the_tables_tok_s_not_a_mean_of_prompts():
    # per prompt, SpecFit's mean beats AR's (one short fast prompt), but the table's whole-call tok/s says it is 5%
    # slower than AR and 6% faster than EAGLE-3: the verdict says what the table shows
    per_prompt = {"ar": [100.0, 100.0, 100.0], "eagle3": [90.0, 90.0, 90.0], "specfit": [94.0, 95.0, 150.0]}
    text = table_verdict(ROWS, per_prompt)
    assert text.startswith("SpecFit -5% against AR") and "+6% against EAGLE-3" in text
    assert "3 prompts" in text
    steady = {"ar": [100.0] * 3, "eagle3": [90.0] * 3, "specfit": [94.0, 95.0, 96.0]}
    assert table_verdict(ROWS, steady).endswith("slower than AR here")
    rows = [dict(r, tok_s=t) for r, t in zip(ROWS, (100.0, 90.0, 110.0))]
    assert table_verdict(rows, {"ar": [100.0] * 3, "eagle3": [90.0] * 3, "specfit": [109.0, 110.0, 111.0]}) \
        .endswith("faster than both here")
    assert table_verdict(ROWS, per_prompt).endswith("(inside the spread)")  # a 50% swing hides a 5% loss


def test_the_default_table_fits_a_terminal_with_both_ratios():
    lines = narrow_table(ROWS, "title").splitlines()
    assert max(map(len, lines)) <= 80
    head = lines[1].split()
    assert head == ["method", "tok/s", "vs", "AR", "vs", "EAGLE-3", "tok/cyc", "copies/tok"]
    specfit = lines[-1]
    assert "x0.95" in specfit and "x1.06" in specfit and "2.10" in specfit and "9.50" in specfit
