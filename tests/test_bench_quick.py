"""``specfit bench --quick`` is a smoke run of a minute or two (issue 53, item 5): one cell of the table (12 slots,
the emulated link), the demo's three methods, three short prompts per workload, where the command line did not say
otherwise; it runs as typed in tests/test_commands_as_printed.py."""

from specfit import cli
from specfit.evaluation import bench


def test_quick_is_one_cell_of_three_methods_unless_told_otherwise():
    args = cli.command_parser("bench").parse_args(["--quick"])
    bench.quick(args)
    assert (args.slots, args.regimes, args.methods) == (["12"], ["emulated"], ["ar", "eagle3", "specfit"])
    assert (args.cnn_prompts, args.gsm8k_prompts, args.max_new_tokens) == (3, 3, 16)
    args = cli.command_parser("bench").parse_args(["--quick", "--slots", "6", "24", "--max-new-tokens", "8",
                                                   "--methods", "ar", "specfit"])
    bench.quick(args)
    assert args.slots == ["6", "24"] and args.max_new_tokens == 8 and args.methods == ["ar", "specfit"]
    assert args.regimes == ["emulated"] and args.gsm8k_prompts == 3
    bench.QUICK["slots"].append("x")  # quick copies its lists: a run cannot change the next one's defaults
    try:
        other = cli.command_parser("bench").parse_args(["--quick"])
        bench.quick(other)
        other.slots.append("y")
        assert bench.QUICK["slots"] == ["12", "x"]
    finally:
        bench.QUICK["slots"].remove("x")


def test_quick_says_what_it_runs():
    text = " ".join(next(a.help for a in cli.command_parser("bench")._actions if "--quick" in a.option_strings)
                    .split())
    assert text.startswith("a smoke run of a minute or two: 3 prompts per workload") and "12 slots" in text
