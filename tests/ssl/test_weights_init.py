"""``MODEL.WEIGHTS_INIT.PARAMS_FILE``: a run's trunk starts from the weights a user has (a model's
state_dict, a DDP or Lightning checkpoint, vissl's, a trunksplit run's), compared with the model
that saved them; and the files that are not the trunk's are refused saying why, before anything is written."""
import os
import pickle

import pytest
import torch
import torchvision
from PIL import Image

from trunksplit.ssl import knn
from trunksplit.ssl.config import load_config
from trunksplit.ssl.model import build_ssl_model
from trunksplit.ssl.loop import train
from trunksplit.ssl.weights_init import start_from_weights

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")
SMALL = ["MODEL.TRUNK.NAME", "resnet18", "DATA.CROP_SIZES", "[32]", "DATA.IMAGE_SIZE", "40", "TRAIN.BATCH_SIZE_PER_RANK", "4",
         "MODEL.HEAD.HIDDEN_DIM", "64", "DATA.NUM_WORKERS", "0"]


def _saved(tmp_path, name, state) -> str:
    path = str(tmp_path / name)
    torch.save(state, path)
    return path


def _resnet18(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torchvision.models.resnet18()


def _trunk_is(trunk, model, entries=None) -> None:
    """The trunk holds ``model``'s tensors (``entries``: only those, e.g. its parameters)."""
    reference = model.state_dict()
    held = trunk.model_state_dict()
    assert set(held) == {k for k in reference if not k.startswith("fc.")}
    for name in entries or held:
        assert torch.equal(held[name], reference[name]), name


def _labelled_folder(root) -> str:
    for label in range(2):
        os.makedirs(root / f"class_{label}")
        for i in range(2):
            Image.new("RGB", (40, 40), (200 * label, 40 * i, 90)).save(root / f"class_{label}" / f"{i}.png")
    return str(root)


def test_a_run_starts_from_a_ddp_saved_state_dict_resumes_without_it_and_untrained_knn_reads_it(tmp_path, capsys, monkeypatch):
    """A Lightning-style checkpoint of a DDP-wrapped torchvision model: at learning rate 0 the trained
    trunk's parameters are still the file's (its classifier left out, and said); ``trunksplit knn
    --untrained`` evaluates the model the run started from, the file's; ``--resume`` does not read the
    file again (the checkpoint holds the weights): gone, or named anew, it changes nothing, and is not said."""
    source = _resnet18(seed=1)
    path = _saved(tmp_path, "lightning.ckpt", {"epoch": 3, "state_dict": {f"module.{k}": v for k, v in source.state_dict().items()}})
    folder = _labelled_folder(tmp_path / "labelled")
    out = str(tmp_path / "run")
    overrides = [*SMALL, "OUTPUT_DIR", out, "MODEL.WEIGHTS_INIT.PARAMS_FILE", path, "OPTIM.LR", "0", "TRAIN.CHECKPOINT_EVERY", "1"]
    model, _ = train(load_config(QUICK, [*overrides, "TRAIN.STEPS", "1"]))
    _trunk_is(model.trunk, source, entries=[name for name, _ in source.named_parameters() if not name.startswith("fc.")])
    assert f"trunk weights: 120 tensors from {path} (under 'state_dict.module.'); left out, the model's beyond the trunk: fc.bias, fc.weight" in capsys.readouterr().out
    evaluated = []
    monkeypatch.setattr(knn.KnnMonitor, "evaluate", lambda self, trunk, *a, **k: evaluated.append(trunk) or {"knn_top1": 0.0, "knn_top5": 0.0})
    knn.knn_of_run(out, folder, folder, untrained=True)
    _trunk_is(evaluated[0], source)  # every entry, running statistics too: untrained
    os.remove(path)
    with pytest.warns(UserWarning, match=r"^--resume: TRAIN.STEPS \(1 then, 2 now\) changed"):  # a file named anew is not said either
        train(load_config(QUICK, [*overrides, "TRAIN.STEPS", "2", "MODEL.WEIGHTS_INIT.PARAMS_FILE", str(tmp_path / "elsewhere.pt")]), resume=True)


def _dino_checkpoint(tmp_path) -> tuple:
    cfg = load_config(QUICK, [*SMALL, "METHOD.NAME", "dino", "DATA.CROP_COUNTS", "[2]", "METHOD.NUM_PROTOTYPES", "16"])
    torch.manual_seed(3)
    dino = build_ssl_model(cfg)
    for p in dino.teacher.parameters():
        p.data.add_(1.0)  # a teacher that has moved away from the student
    return _saved(tmp_path, "checkpoint.pt", {"model": dino.state_dict(), "optimizer": {}, "step": 3}), dino


@pytest.mark.parametrize("layout", ["state_dict", "vissl", "trunksplit_dino_teacher", "trunksplit_dino_student"])
def test_every_layout_a_user_has_starts_the_student_and_a_dino_teacher_from_the_same_weights(tmp_path, layout):
    """The trunk's weights, found in the file whichever way it holds them, load into the student's trunk and
    (DINO) its teacher's, which start alike; a trunksplit DINO run's student or teacher, as REMOVE_PREFIX says."""
    source, prefix, saved_trunk = _resnet18(seed=1), "", None
    if layout == "state_dict":
        path = _saved(tmp_path, "r18.pt", source.state_dict())
    elif layout == "vissl":
        trunk = {f"_feature_blocks.{k}": v for k, v in source.state_dict().items() if not k.startswith("fc.")}
        path = _saved(tmp_path, "model_final.torch", {"classy_state_dict": {"base_model": {"model": {"trunk": trunk, "heads": {"0.clf.weight": torch.ones(3)}}}}, "phase_idx": 4})
    else:
        path, dino = _dino_checkpoint(tmp_path)
        saved_trunk = (dino.teacher if layout.endswith("teacher") else dino).trunk
        prefix = "model.teacher.trunk." if layout.endswith("teacher") else "model.trunk"  # the last dot may be left out
    cfg = load_config(QUICK, [*SMALL, "METHOD.NAME", "dino", "DATA.CROP_COUNTS", "[2]", "METHOD.NUM_PROTOTYPES", "16",
                              "MODEL.WEIGHTS_INIT.PARAMS_FILE", path, "MODEL.WEIGHTS_INIT.REMOVE_PREFIX", prefix])
    torch.manual_seed(0)
    model = build_ssl_model(cfg)
    said = start_from_weights(model, cfg)
    assert said.startswith(f"120 tensors from {path}")
    if saved_trunk is None:
        _trunk_is(model.trunk, source)
    else:  # a trunksplit run's trunk, under the trunk's own names
        assert all(torch.equal(v, saved_trunk.state_dict()[k]) for k, v in model.trunk.state_dict().items())
    teacher = model.teacher.trunk.state_dict()
    assert all(torch.equal(v, teacher[k]) for k, v in model.trunk.state_dict().items())


def _refused(tmp_path, name, arch="resnet18"):
    """(the file, the text of its refusal) for a weights file ``name`` made here."""
    if name == "deeper":
        path = _saved(tmp_path, "r34.pt", torchvision.models.resnet34().state_dict())
        return path, f"{path} holds weights under '' of modules resnet18 does not have (layer1.2, layer2.2, layer2.3, layer3.2 and 4 more): a checkpoint of another model"
    if name == "shallower":
        path = _saved(tmp_path, "r18.pt", torchvision.models.resnet18().state_dict())
        return path, (f"{path}: it holds no complete set of the trunk's 265 weights under any prefix: the most, 100, under '', lacking "
                      "layer1.0.bn3.bias, layer1.0.bn3.running_mean, layer1.0.bn3.running_var, layer1.0.bn3.weight and 161 more: is it a checkpoint of resnet50?")
    if name == "wider":
        path = _saved(tmp_path, "r50.pt", torchvision.models.resnet50().state_dict())
        return path, f"{path}: its weights do not fit MODEL.TRUNK.NAME wide_resnet50_2 (size mismatch for res2.0.conv1.weight"
    if name == "pickled_object":
        path = str(tmp_path / "model.pkl")
        with open(path, "wb") as f:
            pickle.dump(torchvision.models.resnet18(), f)
        return path, f"{path}: cannot read it as weights (UnpicklingError"
    if name == "no_tensors":
        path = _saved(tmp_path, "empty.pt", {"epoch": 3})
        return path, f"{path}: it holds no tensors"
    if name == "run_folder":
        _saved(tmp_path, "trunk.pt", torchvision.models.resnet18().state_dict())
        return str(tmp_path), f"'{tmp_path}' is not a file ({tmp_path} is a run's folder: {tmp_path / 'trunk.pt'} holds its trained trunk)"
    path = str(tmp_path / "missing.pt")
    return path, f"'{path}' is not a file: give a file of weights"


@pytest.mark.parametrize("name, arch", [("deeper", "resnet18"), ("shallower", "resnet50"), ("wider", "wide_resnet50_2"),
                                        ("pickled_object", "resnet18"), ("no_tensors", "resnet18"), ("missing", "resnet18"), ("run_folder", "resnet18")])
def test_a_file_that_is_not_the_trunks_is_refused_saying_why_before_anything_is_written(tmp_path, name, arch):
    path, why = _refused(tmp_path, name)
    out = tmp_path / "run"
    with pytest.raises(ValueError) as refused:
        train(load_config(QUICK, [*SMALL, "MODEL.TRUNK.NAME", arch, "OUTPUT_DIR", str(out), "MODEL.WEIGHTS_INIT.PARAMS_FILE", path, "TRAIN.STEPS", "1"]))
    assert str(refused.value).startswith(f"MODEL.WEIGHTS_INIT.PARAMS_FILE {why}"), str(refused.value)
    assert not out.exists()


def test_a_file_holding_the_trunk_twice_names_both_places_and_a_prefix_must_be_one_of_them(tmp_path):
    path, _ = _dino_checkpoint(tmp_path)
    for prefix, said in [("", f"MODEL.WEIGHTS_INIT.PARAMS_FILE {path} holds the trunk's weights under 2 prefixes, 'model.teacher.trunk.', "
                              "'model.trunk.': set MODEL.WEIGHTS_INIT.REMOVE_PREFIX to the one to start from"),
                         ("model.head.", f"MODEL.WEIGHTS_INIT.REMOVE_PREFIX 'model.head.': {path} does not hold the trunk's weights under it; "
                                         "it does under 'model.teacher.trunk.', 'model.trunk.'")]:
        cfg = load_config(QUICK, [*SMALL, "MODEL.WEIGHTS_INIT.PARAMS_FILE", path, "MODEL.WEIGHTS_INIT.REMOVE_PREFIX", prefix])
        model = build_ssl_model(cfg)
        before = {k: v.clone() for k, v in model.trunk.state_dict().items()}
        with pytest.raises(ValueError) as refused:
            start_from_weights(model, cfg)
        assert str(refused.value).startswith(said), str(refused.value)
        assert all(torch.equal(before[k], v) for k, v in model.trunk.state_dict().items())  # nothing loaded
    with pytest.raises(ValueError, match="MODEL.WEIGHTS_INIT.REMOVE_PREFIX 'module.' says where the trunk is in MODEL.WEIGHTS_INIT.PARAMS_FILE: give that file too"):
        load_config(QUICK, ["MODEL.WEIGHTS_INIT.REMOVE_PREFIX", "module."])


def test_a_finished_runs_trunk_weights_load_into_the_plain_model_and_start_another_run(tmp_path, capsys):
    """A DINO run ends by writing its teacher's trunk (what DINO evaluates and releases) under
    torchvision's names: the plain model without its classifier loads it strictly and computes the
    teacher's features, not the student's; a new run's MODEL.WEIGHTS_INIT takes the file as it is."""
    out = tmp_path / "dino"
    dino = [*SMALL, "METHOD.NAME", "dino", "DATA.CROP_COUNTS", "[2]", "METHOD.NUM_PROTOTYPES", "16", "OUTPUT_DIR", str(out), "TRAIN.STEPS", "1"]
    model, _ = train(load_config(QUICK, dino))
    plain = torchvision.models.resnet18()
    plain.fc = torch.nn.Identity()
    plain.load_state_dict(torch.load(out / "trunk.pt", weights_only=True))  # strict
    x = torch.randn(2, 3, 32, 32)
    plain.eval(), model.eval()
    with torch.no_grad():
        assert torch.equal(plain(x), model.teacher.trunk(x)[-1]) and not torch.equal(plain(x), model.trunk(x)[-1])
    cfg = load_config(QUICK, [*SMALL, "MODEL.WEIGHTS_INIT.PARAMS_FILE", str(out / "trunk.pt")])
    again = build_ssl_model(cfg)
    assert start_from_weights(again, cfg) == f"120 tensors from {out / 'trunk.pt'}"
    again.eval()
    with torch.no_grad():
        assert torch.equal(again.trunk(x)[-1], plain(x))
