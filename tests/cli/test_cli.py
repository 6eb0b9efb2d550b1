"""The trunksplit command: plan and bench."""
import importlib.metadata
import os
import re
import subprocess
import sys
import warnings

import pytest

import trunksplit
from trunksplit import feature_blocks
from trunksplit.cli import main
from trunksplit.cli.parser import build_parser, warnings_as_lines

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_plan_prints_the_table_with_predicted_memory(capsys):
    assert main(["plan", "--arch", "resnet18", "--splits", "3", "--strategy", "balanced", "--input", "2x3x64x64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SplitPlan (balanced, 3 segments, predicted peak")
    assert "predicted peak (MiB)" in out and "of unsplit" in out


def test_plan_and_fit_say_each_phase_to_a_log_file(capsys):
    """stderr captured here, as in a log file, is not a terminal: no progress bar, a plain line per phase."""
    assert main(["plan", "--arch", "resnet18", "--splits", "3", "--strategy", "balanced", "--input", "2x3x64x64"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("profiling units: ") and err[1].startswith("profiling units: done in ") and err[2] == "searching the plan", err
    assert main(["fit", "--arch", "resnet18", "--input", "3x32x32", "--memory", "300MiB", "--no-verify"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "fitting: profiling, then searching the largest batch" and err[1].startswith("profiling units at two batches: "), err
    assert err[2].startswith("profiling units at two batches: done in "), err


def test_plan_with_a_budget_lists_its_regions(capsys):
    assert main(["plan", "--arch", "resnet50", "--budget", "0.6", "--gradients", "kept", "--input", "2x3x96x96"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SplitPlan (budget") and "| regions" in out and "save_expensive regions" in out


def test_plan_with_an_impossible_budget_says_so_in_the_commands_terms(capsys):
    """The planner's advice names the library's arguments (gradients="kept", trunksplit.fit); the
    command says the flags a user of it types instead."""
    assert main(["plan", "--arch", "resnet18", "--budget", "1000", "--input", "2x3x64x64"]) == 2
    err = capsys.readouterr().err
    assert "smallest feasible budget" in err
    assert all(flags in err for flags in ("--gradients kept", "--gradients in_backward", "trunksplit fit --memory SIZE", "larger batch (--input)")), err
    assert 'gradients="' not in err and "trunksplit.fit" not in err, err


@pytest.mark.parametrize("device", ["gpu", "cuda:99", "mps", "meta"])
def test_a_device_this_machine_lacks_is_said_before_any_work(tmp_path, capsys, device):
    """A missing GPU once read as the model failing its input ("resnet18 cannot run an input of shape
    3x64x64: Found no NVIDIA driver"); now each command says it of --device, before any work. So for
    another device type this machine lacks (an Apple GPU's mps: a traceback from moving the model). ``plan`` had no
    --device: it measured on the CPU whatever the trunk would train on."""
    import importlib.util

    import torch

    if device == "mps" and torch.mps.is_available():
        pytest.skip("this machine has an Apple GPU: --device mps is no mistake here")
    said = {"gpu": "is not a device: cpu, cuda, cuda:N, or auto", "cuda:99": f"torch sees {torch.cuda.device_count()} GPU(s) on this machine"}.get(
        device, f"torch has no usable {device} device on this machine; use cpu, or auto")
    quick = os.path.join(ROOT, "configs", "quickstart.yaml")
    wrapped = [["plan", "--arch", "hf:beit", "--input", "2x3x32x32", "--budget", "0.9"]] if importlib.util.find_spec("transformers") else []
    for argv in (["fit", "--arch", "resnet18", "--input", "3x64x64", "--memory", "1GiB"], ["bench", "--arch", "resnet18", "--out", str(tmp_path / "bench")],
                 ["fit", "--config-file", quick, "--memory", "1GiB"], ["knn", str(tmp_path / "run"), "--train", str(tmp_path), "--val", str(tmp_path)],
                 ["plan", "--arch", "resnet18", "--input", "2x3x64x64"], ["plan", "--config-file", quick], *wrapped):
        assert main([*argv, "--device", device]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"error: --device {repr(device) if device == 'gpu' else device}") and said in err, (argv, err)
    assert os.listdir(tmp_path / "bench") == []  # made by the argument check (writable?), nothing written in it


def test_ctrl_c_during_a_command_says_it_stopped_not_where(monkeypatch, capsys):
    """A real SIGINT, as a terminal's Ctrl-C sends it, while ``fit`` profiles: one line and the shell's code
    for SIGINT (130), not a traceback into whichever library line was running."""
    import signal

    class InterruptedWhileProfiling:  # stderr, as a log file: a terminal's Ctrl-C arrives as fit says its phase
        def __init__(self, err):
            self.err, self.said, self.sent = err, "", False

        def write(self, text):
            self.err.write(text)
            self.said += text
            if "\nprofiling units at two batches: " in self.said and self.said.endswith("\n") and not self.sent:
                self.sent = True  # its line said, the profiling under way
                signal.raise_signal(signal.SIGINT)
            return len(text)

        def __getattr__(self, name):
            return getattr(self.err, name)

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as in a command
    try:
        monkeypatch.setattr(sys, "stderr", InterruptedWhileProfiling(sys.stderr))
        rc = main(["fit", "--arch", "resnet18", "--input", "3x32x32", "--memory", "300MiB"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C reached the caller of trunksplit's main as a KeyboardInterrupt")
    finally:
        signal.signal(signal.SIGINT, before)
        monkeypatch.undo()
    said = capsys.readouterr()
    assert rc == 130 and said.err.splitlines()[-1] == "interrupted: trunksplit fit stopped before it finished and kept nothing; run it again", said.err
    assert "Traceback" not in said.err and said.out == "", said  # no batch said as fitting


def test_plan_rejects_an_unknown_arch(capsys):
    assert main(["plan", "--arch", "resnet9000", "--input", "2x3x64x64"]) == 2
    assert "resnet9000" in capsys.readouterr().err


def test_plan_rejects_a_bad_shape(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--input", "2x3x64"])
    assert "8x3x224x224" in capsys.readouterr().err


def test_a_shape_is_read_as_torch_prints_it_too():
    for text in ("2x3x64x64", "2,3,64,64", "(2, 3, 64, 64)"):
        assert build_parser().parse_args(["plan", "--input", text]).input == (2, 3, 64, 64), text
    assert build_parser().parse_args(["fit", "--memory", "1GiB", "--input", "3, 64, 64"]).input == (3, 64, 64)


def test_a_commands_warnings_print_as_one_line_each():
    """What a command warns (an unreadable image, a torn metrics line) reads as ``warning: ...``, without the
    library's file, line and source line; the usual form comes back after the command."""
    usual = warnings.formatwarning("torn", UserWarning, "trunksplit/ssl/report.py", 43)
    with warnings_as_lines():
        assert warnings.formatwarning("skipping a.jpg", UserWarning, "trunksplit/ssl/loop.py", 272) == "warning: skipping a.jpg\n"
        assert warnings.formatwarning("old", FutureWarning, "x.py", 1) == "warning (FutureWarning): old\n"
    assert warnings.formatwarning("torn", UserWarning, "trunksplit/ssl/report.py", 43) == usual and "report.py:43" in usual


def test_bench_writes_a_table_and_a_plot(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "--arch", "resnet18", "--input", "2x3x32x32", "--splits", "3", "--budgets", "0.9", "--repeats", "1", "--out", str(out),
                 "--objective", "auto", "flops"]) == 0
    table = (out / "benchmark.md").read_text()
    assert table.startswith("### resnet18, input (2, 3, 32, 32), cpu,")  # --input as plan takes it: the batch every row steps
    assert "budget plans priced in flops\n" in table  # auto, the trunk's default, is FLOPs on a CPU: once
    for row in ["plain", "checkpoint_sequential k=3", "vissl k=3", "balanced k=3", "budget 0.9", "budget 0.9, cuts only", "budget floor", "wrap every block"]:
        assert f"| {row}" in table
    assert (out / "benchmark.png").read_bytes()[:4] == b"\x89PNG"
    assert table in capsys.readouterr().out


def test_bench_in_backward_steps_every_row_with_the_optimizer_and_its_plain_row_is_the_plain_model_stepped_so(tmp_path):
    """``bench --gradients in_backward`` (refused before: plan and fit took the mode, bench did not): every row's
    trunk steps ``--optimizer`` in backward, so its plain row's peak is the plain model's second step with AdamW
    stepped in backward (its state made by the first, each gradient freed at its update), measured here by hand;
    each plan's prediction is of that mode."""
    import torch
    import torchvision
    from trunksplit import PeakMemory, optimizer_in_backward

    out = tmp_path / "bench"
    assert main(["bench", "--arch", "resnet18", "--input", "2x3x32x32", "--splits", "2", "--budgets", "--repeats", "1",
                 "--no-selective", "--gradients", "in_backward", "--optimizer", "adamw", "--out", str(out)]) == 0
    table = (out / "benchmark.md").read_text()
    assert "peak beyond parameters and adamw's state (adamw stepped in backward)" in table
    rows = {c[0]: c for c in ([v.strip() for v in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("| ") and "---" not in line)}
    assert set(rows) == {"plan", "plain", "checkpoint_sequential k=2", "vissl k=2", "balanced k=2"}
    torch.manual_seed(0)
    model = torchvision.models.resnet18()
    model.fc = torch.nn.Identity()
    optimizer_in_backward(model, torch.optim.AdamW, lr=1e-3)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    model(x).sum().backward()
    with PeakMemory() as mem:
        model(x).sum().backward()
    assert abs(float(rows["plain"][1]) - mem.peak_bytes / 2**20) <= 0.05, (rows["plain"], mem.peak_bytes)
    for name in ["plain", "vissl k=2", "balanced k=2"]:
        assert abs(float(rows[name][4].rstrip("%"))) <= 1.0, rows[name]  # predicted vs measured


def test_bench_in_backward_names_the_optimizers_it_steps_before_measuring(tmp_path):
    from trunksplit.cli.bench import run_benchmark

    with pytest.raises(ValueError, match="optimizer is one of sgd, lars, adamw, got 'lbfgs'"):
        run_benchmark(["resnet18"], input_shape=(2, 3, 32, 32), gradients="in_backward", optimizer="lbfgs", out_dir=str(tmp_path / "bench"))
    assert not (tmp_path / "bench").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["plan", "--splits", "0"], "--splits: expected a whole number >= 1"),
        (["plan", "--budget", "nan"], "--budget: a budget must be"),
        (["plan", "--budget", "-5"], "--budget: a budget must be"),
        (["plan", "--budget", "inf"], "--budget: a budget must be"),
        (["bench", "--repeats", "0"], "--repeats: expected a whole number >= 1"),
        (["bench", "--splits", "0"], "--splits: expected a whole number >= 1"),
        (["bench", "--out", "/proc/cannot/write"], "--out: cannot write to"),
        (["bench", "--input", "3x64x64"], "--input: expected a shape of 4 sizes, each at least 1, like 8x3x224x224"),  # plan's words
    ],
)
def test_bad_arguments_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as caught:
        main(args)
    assert caught.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,message",
    [
        (["plan", "--arch", "resnet18", "--features", "res9", "--input", "2x3x64x64"], "unknown feature key(s) ['res9']"),
        (["plan", "--arch", "resnet18", "--input", "2x4x64x64"], "resnet18 cannot run an input of shape 2x4x64x64"),
        # torch's BatchNorm raises a ValueError (res5 sees one value per channel): it read as a refusal of trunksplit's
        (["plan", "--arch", "resnet18", "--input", "1x3x32x32"], "error: resnet18 cannot run an input of shape 1x3x32x32: Expected more than 1 value per channel"),
        (["plan", "--arch", "get_model", "--input", "2x3x64x64"], "torchvision has no model 'get_model'"),
        (["bench", "--arch", "resnet18", "nope"], "torchvision has no model 'nope'"),
        (["bench", "--arch", "resnet18", "--input", "2x4x64x64", "--repeats", "1"], "cannot benchmark an input of shape 2x4x64x64"),
    ],
)
def test_bad_requests_are_errors_not_tracebacks(args, message, capsys):
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_bench_takes_byte_budgets_and_more_splits_than_layers(tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["bench", "--arch", "resnet18", "--input", "2x3x32x32", "--splits", "30", "--budgets", "2e9", "--repeats", "1", "--no-selective", "--out", str(out)]
    assert main(args) == 0
    table = (out / "benchmark.md").read_text()
    assert "| budget 2e+09" in table and "only 14 layers" in table
    budget_row = next(line for line in table.splitlines() if line.startswith("| budget 2e+09"))
    assert "| 1.00 " in budget_row  # 2 GB is above the unsplit peak: nothing is cut


@pytest.mark.parametrize("arch,shape", [("vit_b_16", "1x3x64x64"), ("mobilenet_v3_small", "2x3x64x64"), ("swin_t", "1x3x64x64")])
def test_plan_takes_every_family(arch, shape, capsys):
    assert main(["plan", "--arch", arch, "--splits", "3", "--strategy", "balanced", "--input", shape]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SplitPlan (balanced, 3 segments") and "of unsplit" in out


def test_bench_data_measures_each_recipe_on_synthetic_images_and_on_jpeg_files(tmp_path, capsys):
    assert main(["bench-data", "--recipes", "simclr", "dino", "--workers", "0", "1", "--steps", "1", "--batch", "2", "--jpegs", "4"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "recipe" not in line]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert [(c[0], c[1]) for c in cells] == [("synthetic", "simclr"), ("synthetic", "dino"), ("jpeg folder", "simclr"), ("jpeg folder", "dino")]
    assert all(float(v) > 0 for c in cells for v in c[2:]) and all(len(c) == 4 for c in cells)


def test_bench_data_names_the_recipes_it_has(capsys):
    assert main(["bench-data", "--recipes", "moco", "--workers", "0", "--steps", "1", "--batch", "2", "--jpegs", "2"]) == 2
    assert "no recipe 'moco'" in capsys.readouterr().err


def test_bench_data_takes_a_recipe_file_and_says_where_names_come_from_when_installed_from_a_wheel(tmp_path, monkeypatch, capsys):
    """An install from a wheel has no configs/recipes: a name is refused saying so (it crashed on the missing
    folder), before any JPEG is written; a YAML path runs anywhere."""
    import shutil

    from trunksplit.cli import bench_data

    recipe = shutil.copy(os.path.join(bench_data.RECIPES, "simclr.yaml"), tmp_path / "mine.yaml")
    monkeypatch.setattr(bench_data, "RECIPES", str(tmp_path / "site-packages" / "configs" / "recipes"))
    monkeypatch.setattr(bench_data, "write_jpegs", lambda *a: pytest.fail("images written before the recipes were checked"))
    assert main(["bench-data", "--recipes", "simclr", "--workers", "0", "--steps", "1", "--batch", "2", "--jpegs", "2"]) == 2
    err = capsys.readouterr().err
    assert "no recipe 'simclr'" in err and "configs/recipes/ in a clone" in err and "give a recipe's YAML path" in err
    assert main(["bench-data", "--recipes", str(tmp_path / "nope.yaml"), "--workers", "0", "--steps", "1", "--batch", "2", "--folder", str(tmp_path)]) == 2
    assert "nope.yaml does not exist" in capsys.readouterr().err
    monkeypatch.undo()
    assert main(["bench-data", "--recipes", str(recipe), "--workers", "0", "--steps", "1", "--batch", "2", "--jpegs", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "mine.yaml" in line]
    assert len(rows) == 2 and all(float(r.strip("|").split("|")[2]) > 0 for r in rows)


def test_plan_for_one_of_several_fsdp_ranks_prints_the_breakdown(capsys):
    assert main(["plan", "--arch", "resnet18", "--input", "2x3x64x64", "--strategy", "balanced", "--splits", "3"]) == 0
    single = capsys.readouterr().out
    assert main(["plan", "--arch", "resnet18", "--input", "2x3x64x64", "--strategy", "balanced", "--splits", "3", "--world-size", "4", "--optimizer", "adamw"]) == 0
    sharded = capsys.readouterr().out
    assert "per rank at world size 1" in single and "per rank at world size 4" in sharded

    def mib(text, part):
        return float(text.split(f"{part} ")[1].split(" MiB")[0])

    assert mib(sharded, "parameters") < mib(single, "parameters") / 2  # the trunk's weights in quarters, the classifier whole
    assert mib(sharded, "optimizer") > 0 and mib(single, "optimizer") > 0


def test_plan_counts_only_the_parameters_the_trunk_trains(capsys):
    """--features res4: res5 and the classifier are not in the trunk, so not in its per-rank breakdown."""
    import torchvision

    from trunksplit.planning.sharding import gib

    assert main(["plan", "--arch", "resnet18", "--features", "res4", "--input", "2x3x64x64"]) == 0
    model = torchvision.models.resnet18()
    trained = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith(("layer4", "fc")))
    assert f"parameters {gib(trained)}," in capsys.readouterr().out


def test_every_option_of_every_subcommand_says_what_it_is_and_its_default(capsys):
    from trunksplit.cli.parser import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and "plan" in a.choices).choices  # argparse keeps them here
    for name, sub in subparsers.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings[0]} has no help"
        text = sub.format_help()
        assert "(default:" in text or not any(a.option_strings and a.dest != "help" for a in sub._actions), name
        assert "(default: None)" not in text and "(default: False)" not in text and "(default: )" not in text, name


def test_each_default_help_shows_is_what_that_option_takes_on_the_command_line():
    """``--input`` showed its default as ``(8, 3, 224, 224)``, which ``--input`` refuses; a default as shown
    must parse back to the default itself."""
    import re

    from trunksplit.cli.parser import build_parser
    from trunksplit.planning.budget import MemoryBudget

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and "plan" in a.choices).choices
    required = {"fit": ["--memory", "1GiB"], "knn": ["run", "--train", "t", "--val", "v"], "report": ["run"]}
    shown = 0
    for name, sub in subparsers.items():
        for action in sub._actions:
            said = re.search(r"\(default: ([^)]*)\)$", action.help or "")
            if not action.option_strings or said is None or action.default is None:
                continue
            args = parser.parse_args([name, *required.get(name, []), action.option_strings[0], *said.group(1).split()])
            got, default = getattr(args, action.dest), action.default
            if action.dest == "budgets":  # typed in, a budget is read at once; the default's numbers are read by the trunk
                default = [MemoryBudget.parse(b) for b in default]
            assert got == default, (name, action.option_strings[0], said.group(1))
            shown += 1
    assert shown >= 25


def test_help_and_argument_errors_answer_without_importing_torch():
    """A new user's first call: ``trunksplit --help`` or a typo must answer in a moment, not after
    torch loads (seconds on a busy machine). Run in a fresh interpreter, where nothing imported torch."""
    script = ("import sys\nfrom trunksplit.cli import main\n"
              "for argv in (['--help'], ['--version'], ['plan', '--help'], ['fit', '--memory', 'lots'], ['plan', '--input', '3x3'], ['plan', '--input', '0x3x64x64']):\n"
              "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
              "print('torch imported' if 'torch' in sys.modules else 'no torch')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().endswith("no torch"), done.stdout[-300:] + done.stderr[-300:]
    assert f"\ntrunksplit {importlib.metadata.version('trunksplit')}\n" in done.stdout  # --version: the installed distribution's
    assert importlib.metadata.version("trunksplit") == trunksplit.__version__  # setup.py reads it from the package: one version
    said = done.stdout.split("usage: trunksplit")[1]  # the help speaks to whoever runs it, not of this module's imports
    assert "(plan)" in said and "tools/train.py" in said and "``" not in said and "imports no torch" not in said, said
    assert "expected a shape of 4 sizes, each at least 1, like 8x3x224x224, got '3x3'" in done.stderr and "--memory" in done.stderr
    assert "each at least 1, like 8x3x224x224, got '0x3x64x64'" in done.stderr  # an empty batch: the rule it breaks is said
    as_module = subprocess.run([sys.executable, "-m", "trunksplit", "fit", "--memory", "lots"], capture_output=True, text=True, timeout=120)
    assert as_module.returncode == 2 and "usage: trunksplit fit" in as_module.stderr, as_module.stderr[-300:]  # where the script is not on PATH


@pytest.mark.parametrize("flag,value,key", [("--arch", "resnet18", "MODEL.TRUNK.NAME"), ("--input", "3x32x32", "DATA.CROP_SIZES"),
                                            ("--gradients", "kept", "TRAIN.GRADIENTS")])
def test_fit_with_a_config_refuses_a_flag_the_config_sets_naming_the_key(flag, value, key, capsys):
    """Ignored, ``--arch resnet18`` would fit the config's ResNet-50 and print a batch for the wrong model."""
    config = os.path.join(ROOT, "configs", "quickstart.yaml")
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--config-file", config, "--memory", "1GiB", flag, value])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and f"the config says what {flag} would: set {key} after it" in err, err


def test_the_public_names_load_on_first_use_and_stay_what_they_name():
    """``import trunksplit`` loads no torch; each public name is what its module defines, even where a
    submodule shares its name (``trunksplit.fit``, the function, once the module fit.py is imported)."""
    script = ("import sys, trunksplit\nassert 'torch' not in sys.modules\nimport trunksplit.fit, trunksplit.ssl.fit_step\n"
              "from trunksplit import fit\nimport inspect\nassert inspect.isfunction(fit) and trunksplit.fit is fit, trunksplit.fit\n"
              "missing = [n for n in trunksplit.__all__ if not hasattr(trunksplit, n)]\nassert not missing, missing\n"
              "assert set(trunksplit.__all__) <= set(dir(trunksplit))\n"
              "assert not {'importlib', 'sys', 'types', 'TYPE_CHECKING'} & set(dir(trunksplit)), dir(trunksplit)\nprint('ok')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "ok", done.stderr[-600:]
    with pytest.raises(AttributeError, match="no attribute 'CheckpointTrunk'"):
        trunksplit.CheckpointTrunk  # noqa: B018 (a near miss is an AttributeError, not an import)


@pytest.mark.parametrize("arch,near", [("resnet05", "did you mean resnet50"), ("convnext_tinny", "did you mean convnext_tiny")])
def test_a_near_miss_names_the_nearest_models_not_all_of_them(arch, near, capsys):
    assert main(["plan", "--arch", arch, "--input", "2x3x64x64"]) == 2
    err = capsys.readouterr().err
    assert near in err and "alexnet" not in err  # not the 80 names


@pytest.mark.clients  # timm is a clients extra
def test_plan_takes_a_timm_model_by_name(capsys):
    pytest.importorskip("timm")
    assert main(["plan", "--arch", "timm:convnext_atto", "--input", "4x3x64x64", "--budget", "0.7", "--gradients", "kept"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SplitPlan (budget") and "stem .. output" in out and "= 0.70 of unsplit" in out
    # (with the gradients allocated in the step, torch's default, they alone are 0.70 of it at this batch: refused, saying so)
    for wrong, near in (("timm/convnext_atto", "did you mean timm:convnext_atto?"), ("timm:convnext_atoo", "did you mean timm:convnext_atto")):
        assert main(["plan", "--arch", wrong]) == 2
        assert near in capsys.readouterr().err


@pytest.mark.clients
def test_bench_measures_a_timm_model_as_plan_plans_it(tmp_path, capsys):
    """A traced trunk's last block is ``output``, not torchvision's ``flatten``, and it has no stages: bench asked
    for ``flatten`` and took its wrapped rows' block type from the stages, so it refused every timm model."""
    timm = pytest.importorskip("timm")
    assert main(["bench", "--arch", "timm:convnext_atto", "--input", "2x3x64x64", "--splits", "2",
                 "--budgets", "0.9", "--repeats", "1", "--out", str(tmp_path)]) == 0
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:]] for r in (tmp_path / "benchmark.md").read_text().splitlines()
            if r.startswith("| ") and not r.startswith("| plan")}
    units = len(feature_blocks(timm.create_model("convnext_atto", num_classes=0)))  # a traced model's blocks: its units
    assert f"wrap every block ({units})" in rows, sorted(rows)
    plain = float(rows["plain"][0])
    assert float(rows["balanced k=2"][0]) < plain and float(rows[f"wrap every block ({units})"][0]) < plain


def test_a_transformers_model_type_it_cannot_cut_is_wrapped_to_a_budget(capsys):
    """``hf:TYPE`` builds the type's default config (nothing downloaded); a type trunksplit cannot cut (BEiT, whose layers take more than their hidden states;
    those it cuts: tests/chains/test_hugging_face.py) plan wraps to --budget and asks for one, and fit,
    which cuts trunks, says where to go instead."""
    pytest.importorskip("transformers")
    assert main(["plan", "--arch", "hf:beit", "--input", "2x3x32x32"]) == 2
    assert "wrapped block by block to a memory budget, not cut into segments: pass --budget" in capsys.readouterr().err
    assert main(["fit", "--arch", "hf:beit", "--input", "3x32x32", "--memory", "1GiB"]) == 2
    assert "trunksplit plan --arch hf:beit --budget 0.5" in capsys.readouterr().err


@pytest.mark.clients
def test_plan_wraps_a_transformers_model_type_to_a_budget_as_measured(capsys):
    pytest.importorskip("transformers")
    assert main(["plan", "--arch", "hf:beit", "--input", "8x3x64x64", "--budget", "0.7", "--gradients", "kept"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("WrapPlan: ") and "layers.0[" in out
    ratio = float(out.split("measured step peak ")[1].split(" = ")[1].split(" of")[0])
    assert ratio <= 0.7
    assert main(["plan", "--arch", "hf:dinov9", "--budget", "0.7"]) == 2
    assert "did you mean hf:dinov2" in capsys.readouterr().err


QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")
SMALL_RUN = ["MODEL.TRUNK.NAME", "resnet18", "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", "0.25", "DATA.IMAGE_SIZE", "40", "MODEL.HEAD.HIDDEN_DIM", "64", "DATA.NUM_WORKERS", "0", "TRAIN.STEPS", "1",
             "TRAIN.BATCH_SIZE_PER_RANK", "4"]
MULTI_CROP = ["METHOD.NAME", "swav", "METHOD.NUM_PROTOTYPES", "32", "DATA.CROP_SIZES", "[32, 16]", "DATA.CROP_COUNTS", "[2, 4]",
              "DATA.CROP_SCALES", "[[0.4, 1.0], [0.05, 0.4]]"]


def _printed_plans(out):
    """Each printed plan's segments, as (first layer, last layer, checkpointed) rows of its table."""
    plans = []
    for line in out.splitlines():
        if line.startswith("SplitPlan ("):
            plans.append([])
        elif plans and line.startswith("| ") and not line.startswith("| segment"):
            cells = [c.strip() for c in line.split("|")[1:-1]]
            first, _, last = cells[1].partition(" .. ")  # one unit: named once
            plans[-1].append((first, last or first, cells[3] == "yes"))
    return plans


@pytest.mark.parametrize("stepped,large", [(False, 2), (True, 2), (False, 1)], ids=["standard", "stepped_in_backward", "lone_large_crop"])
def test_plan_of_a_config_is_the_plan_the_launcher_trains_each_crop_group_with(tmp_path, capsys, stepped, large):
    """``plan --config-file`` before a run against the run itself: the trunk's plan for each crop group
    (stepped in backward, the first group's backward holds its updates, and its gradients: said, and planned so;
    a lone large crop's group runs without a graph: said, and no plan printed, as the run makes none)."""
    from trunksplit.ssl.config import load_config
    from trunksplit.ssl.loop import train

    overrides = [*SMALL_RUN, *MULTI_CROP, "DATA.CROP_COUNTS", f"[{large}, 4]", "MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS", "3",
                 "OPTIM.IN_BACKWARD", str(stepped)]
    assert main(["plan", "--config-file", QUICK, *overrides]) == 0
    out = capsys.readouterr().out
    assert f"group 1: {large} x 32px crops per image, the trunk on {4 * large} per rank" in out
    assert "group 2: 4 x 16px crops per image, the trunk on 16 per rank" in out
    assert out.count("updates held until the last group's") == stepped
    assert out.count("without a graph (a lone large crop") == (large == 1)
    assert ("input 8x3x32x32" in out) == (large == 2) and "input 16x3x16x16" in out
    model, _ = train(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "run"), *overrides]))
    said = capsys.readouterr().out.split("trunk plan: ")[1].splitlines()[0]
    assert ("group 1 (1 x 32px): without a graph; group 2 (4 x 16px): " in said) == (large == 1), said
    trained = sorted(model.trunk.plans.items(), key=lambda kv: -kv[0][0][0][0][-1])  # by crop size, largest first
    units = trained[0][1].units
    assert _printed_plans(out) == [[(units[s.start], units[s.stop - 1], s.checkpointed) for s in plan.segments] for _, plan in trained]


def test_plan_and_fit_of_a_config_with_world_size_follow_its_distributed_strategy(capsys):
    """--world-size N with a config: one of N ranks as its DISTRIBUTED.STRATEGY runs them. A DDP rank
    plans the whole trunk, as one process does (before, it was planned as an FSDP2 shard), and its fit
    counts DDP's gradient buckets, resident beside the model: one copy of every trained gradient."""
    from trunksplit.ssl.config import load_config
    from trunksplit.ssl.model import build_model

    budget = [*SMALL_RUN, "DATA.CROP_SIZES", "[32]", "TRAIN.GRADIENTS", "kept", "MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET", "0.8"]
    printed = {}
    for name, extra in {"one": ["--world-size", "1"], "ddp": ["--world-size", "4"], "fsdp": ["--world-size", "4", "DISTRIBUTED.STRATEGY", "fsdp"]}.items():
        assert main(["plan", "--config-file", QUICK, *extra, *budget]) == 0
        printed[name] = capsys.readouterr().out
    assert printed["ddp"] == printed["one"] and printed["fsdp"] != printed["one"]
    resident = {}
    for world in ("1", "2"):
        assert main(["fit", "--config-file", QUICK, "--memory", "200MiB", "--world-size", world, *SMALL_RUN, "DATA.CROP_SIZES", "[32]"]) == 0
        resident[world] = float(capsys.readouterr().out.split("resident ")[1].split(" MiB")[0])
    trained = sum(p.numel() * p.element_size() for p in build_model(load_config(QUICK, SMALL_RUN)).parameters() if p.requires_grad)
    assert abs(resident["2"] - resident["1"] - trained / 2**20) <= 0.1, (resident, trained / 2**20)


def test_config_overrides_go_before_or_after_the_flags_as_the_launcher_takes_them(capsys):
    """``plan --config-file C KEY VALUE --world-size 2 KEY VALUE`` plans as with the flag first; before, every
    word after the first override was one (``--world-size`` an unknown config key). A flag spelt wrong among
    them is still a usage error, not a config key."""
    budget = ["DATA.CROP_SIZES", "[32]", "MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET", "0.8", "TRAIN.GRADIENTS", "kept"]
    assert main(["plan", "--config-file", QUICK, "--world-size", "2", *SMALL_RUN, *budget]) == 0
    flags_first = capsys.readouterr().out
    assert main(["plan", "--config-file", QUICK, *SMALL_RUN, "--world-size", "2", *budget]) == 0
    assert capsys.readouterr().out == flags_first and "input 8x3x32x32" in flags_first
    with pytest.raises(SystemExit) as stopped:
        main(["plan", "--config-file", QUICK, *SMALL_RUN, "--world-sise", "2"])
    assert stopped.value.code == 2 and "unrecognized arguments: --world-sise 2" in capsys.readouterr().err


@pytest.mark.parametrize("word,hint", [("resnet50", True), ("timm:resnet18", True), ("TRAIN.STEPS", False)])
def test_bench_given_a_model_without_arch_points_to_it(word, hint, capsys):
    """``trunksplit bench resnet50`` (no overrides there): the usage error says where the model goes; a word that
    reads as no model is refused as before, without the hint."""
    with pytest.raises(SystemExit) as stopped:
        main(["bench", word])
    said = capsys.readouterr().err
    assert stopped.value.code == 2 and f"unrecognized arguments: {word}" in said
    assert (f"give a model with --arch {word}" in said) == hint


def test_fit_of_a_config_with_no_verify_predicts_only(capsys):
    """``--no-verify`` was read only without ``--config-file``: a config's fit ran its checking step anyway."""
    run = ["fit", "--config-file", QUICK, *SMALL_RUN, "DATA.CROP_SIZES", "[32]", "--memory", "200MiB"]
    assert main(run) == 0
    checked = capsys.readouterr()
    assert main([*run, "--no-verify"]) == 0
    predicted = capsys.readouterr()
    assert "by one real step" in checked.err and "by one real step" not in predicted.err
    assert "measured -;" in predicted.out and "measured -;" not in checked.out


def test_plan_of_a_selective_config_lists_the_blocks_it_wraps(capsys):
    select = ["MODEL.ACTIVATION_CHECKPOINTING.STRATEGY", "vissl", "MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS", "1",
              "MODEL.ACTIVATION_CHECKPOINTING.SELECT.every_k", "2", "MODEL.ACTIVATION_CHECKPOINTING.SELECT.types", "[torchvision.models.resnet.BasicBlock]"]
    assert main(["plan", "--config-file", QUICK, *SMALL_RUN, *select]) == 0
    assert capsys.readouterr().out.startswith("MODEL.ACTIVATION_CHECKPOINTING.SELECT wraps 4 blocks, each its own checkpoint (no segments to plan): "
                                              "res2.0 res3.0 res4.0 res5.0")


@pytest.mark.parametrize("args,message", [
    (["--arch", "resnet18"], "the config says what --arch would: set MODEL.TRUNK.NAME after it (trunksplit plan --config-file CONFIG MODEL.TRUNK.NAME VALUE)"),
    (["--budget", "0.5"], "set MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET after it"),
    (["--objective", "time"], "the launcher plans with objective auto"),
])
def test_plan_flags_a_config_sets_are_refused_with_the_key_to_set(args, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["plan", "--config-file", QUICK, *args])
    assert stopped.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--config-file", QUICK, "TRAIN.BATCH_SIZE_PER_RANK", "0", "TRAIN.MEMORY_LIMIT", "2e9"], "TRAIN.BATCH_SIZE_PER_RANK 0 fits the batch when the run starts: trunksplit fit --config-file"),
    (["--config-file", QUICK, "TRAIN.NO_SUCH_KEY", "1"], "unknown config key: TRAIN.NO_SUCH_KEY"),
    (["TRAIN.STEPS", "3"], "config overrides TRAIN.STEPS 3 ... need --config-file"),
    (["resnet50"], "give the model with --arch resnet50"),  # a new user's first guess
    (["timm:resnet18", "--budget", "0.5"], "give the model with --arch timm:resnet18"),
])
def test_plan_of_a_config_that_cannot_be_planned_says_why(args, message, capsys):
    assert main(["plan", *args]) == 2
    assert message in capsys.readouterr().err


def test_plan_and_fit_build_the_resnet_width_asked_and_refuse_one_no_resnet_takes(capsys):
    """``--width``: vissl's WIDTH_MULTIPLIER for the commands that take ``--arch`` (SimCLR's ResNet-50 (2x) planned
    or fitted without a config). The trunk planned is the narrow one (its parameters as the model built so holds
    them); 64 MiB fits hundreds of its images where the full width cannot hold one; a width no ResNet takes, or
    one beside ``--config-file`` (whose key says it), is refused."""
    from trunksplit.planning.sharding import gib
    from trunksplit.ssl.backbones import resnet_of_width

    assert main(["plan", "--arch", "resnet18", "--width", "0.25", "--input", "2x3x64x64"]) == 0
    trained = sum(p.numel() * 4 for n, p in resnet_of_width("resnet18", 0.25).named_parameters() if not n.startswith("fc."))
    assert f"parameters {gib(trained)}," in capsys.readouterr().out
    fit = ["fit", "--arch", "resnet18", "--input", "3x32x32", "--memory", "64MiB", "--no-verify"]
    assert main([*fit, "--width", "0.25"]) == 0
    assert int(re.search(r"^batch (\d+) fits 64.0 MiB", capsys.readouterr().out, re.M).group(1)) > 100
    assert main(fit) == 2 and "too small for a batch of 1" in capsys.readouterr().err
    for command in (["plan", "--arch", "vit_b_16", "--width", "2"], [*fit, "--arch", "vit_b_16", "--width", "2"]):
        assert main(command) == 2
        assert "error: --width 2.0 sets the width of torchvision's ResNets (resnet18 to resnet152, resnext, wide_resnet); vit_b_16 is not one" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--config-file", QUICK, "--width", "2"])
    assert "set MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER after it" in capsys.readouterr().err


def test_bench_steps_the_resnet_width_asked_and_names_it_and_refuses_one_of_its_models_no_width_takes(tmp_path, capsys):
    """``bench --width`` (SimCLR's ResNet-50 (2x) benchmarked as it trains): every row steps the model of that width.
    Its plain step (gradients allocated) holds at least the narrow trunk's gradients, counted here from the model
    built so, and less than the full width's gradients alone; the table names the width. A width one of several
    ``--arch`` cannot take is refused before any is measured, nothing written."""
    from trunksplit.ssl.backbones import resnet_of_width

    out = tmp_path / "bench"
    assert main(["bench", "--arch", "resnet18", "--width", "0.25", "--input", "2x3x32x32", "--splits", "2", "--budgets", "--repeats", "1",
                 "--no-selective", "--out", str(out)]) == 0
    table = (out / "benchmark.md").read_text()
    assert table.startswith("### resnet18 (0.25x), input (2, 3, 32, 32), cpu,")

    def gradients(model):
        return sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("fc.")) / 2**20

    plain = float(re.search(r"^\| plain +\| +([\d.]+) ", table, re.M).group(1))
    assert gradients(resnet_of_width("resnet18", 0.25)) <= plain + 0.05 < gradients(resnet_of_width("resnet18", 1)), table  # MiB to one decimal
    assert main(["bench", "--arch", "resnet18", "vit_b_16", "--width", "2", "--out", str(tmp_path / "refused")]) == 2
    assert "error: --width 2.0 sets the width of torchvision's ResNets (resnet18 to resnet152, resnext, wide_resnet); vit_b_16 is not one" in capsys.readouterr().err
    assert os.listdir(tmp_path / "refused") == []


# glibc's malloc told to hand back every block above 128 KiB (its first threshold, which its default raises as blocks
# are freed), in a fresh process (one whose heap already holds freed memory serves the blocks from it: no reference);
# then the pages each of bench's timed steps faults in, and those of a plain ResNet-18 step handing them back
_BENCH_FAULTS = """
import ctypes, ctypes.util, resource, sys, torch, torchvision
import trunksplit.cli.bench as bench
from trunksplit.cli import main
ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD

def faults(step):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    result = step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, result

model, x = torchvision.models.resnet18(), torch.randn(4, 3, 64, 64)
model(x).sum().backward()
handing_back, _ = faults(lambda: model(x).sum().backward())
timed, counted = bench.wall_seconds, []
bench.wall_seconds = lambda step, device: counted.append(faults(lambda: timed(step, device))) or counted[-1][1]
assert main(["bench", "--arch", "resnet18", "--input", "4x3x64x64", "--splits", "2", "--budgets", "--repeats", "2", "--no-selective",
             "--device", "cpu", "--out", sys.argv[1]]) == 0
print(handing_back, *[f for f, _ in counted])
"""


@pytest.mark.slow  # a second Python (7 s); the fast suite keeps glibc taking the settings (tests/ssl/test_host_memory.py)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_bench_on_a_cpu_times_steps_that_reuse_the_memory_the_step_before_freed(tmp_path):
    """With glibc handing freed blocks back, every step faults its activations' pages in again, the more the
    higher its peak: bench timed SimCLR's ResNet-50 (2x) plain step slower than its checkpointed ones (0.66-0.73x
    of it, docs/benchmarks.md). On a CPU it keeps freed memory, as the launcher does: no timed step faults in a
    fifth of the pages the plain ResNet-18 step does handing them back (the kernel's count: 0 to 4,600 against 50,000)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # a user's own MALLOC_* wins over the command's setting
    done = subprocess.run([sys.executable, "-c", _BENCH_FAULTS, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    handing_back, *timed = map(int, done.stdout.split()[-13:])
    assert len(timed) == 3 * 4  # an untimed round, then two, of four rows (plain, checkpoint_sequential, vissl, balanced)
    assert handing_back > 10 * 4 * 64 * 32 * 32 * 4 // os.sysconf("SC_PAGE_SIZE"), handing_back  # the count sees the stem's output and more
    assert max(timed) < handing_back / 5, (timed, handing_back)
