"""Configuration precedence, a mixed-precision run (bf16 compute, float32 weights/logits/loss), and
TensorFlow's oneDNN kernels in kt-train."""

import json
import math
import os
import subprocess
import sys
import warnings

import pytest

from conftest import COMMAND_ENV, MULTI30K, REPO, SUBPROCESS_ENV, TF_LOG_LINE, multi30k_lines, needs_multi30k
from conftest import history_rows, two_batch_epochs_args, write_lines
from training import ONEDNN_ENV
from keras_transformer.renamed import REMOVED_IN
from training.config import default, resolve_settings


def test_config_precedence(tmp_path):
    cfg = resolve_settings([])
    assert cfg.preset == default("preset") and cfg.tokens_per_batch == default("tokens_per_batch")
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"preset": "base", "epochs": 30, "warmup_steps": 100,
                             "model": {"dropout": 0.2, "norm_first": True}}))
    cfg = resolve_settings(["--config", str(f), "--epochs", "5", "--model-arg", "dropout=0.3",
                          "--model-arg", "num_heads=4"])
    assert cfg.preset == "base" and cfg.warmup_steps == 100  # from the file
    assert cfg.epochs == 5  # flag beats file
    assert cfg.model == {"dropout": 0.3, "norm_first": True, "num_heads": 4}
    assert resolve_settings(["--train-files", "a", "b"]).dataset == "files"
    f.write_text(json.dumps({"epoch": 3}))
    with pytest.raises(SystemExit, match="epoch"):
        resolve_settings(["--config", str(f)])


def test_the_dropout_flag_sets_the_models_dropout_with_or_without_a_config_file(tmp_path):
    """--dropout X is --model-arg dropout=X: it sets the "model" setting's dropout, over the --config file's."""
    assert resolve_settings(["--dropout", "0.1"]).model == {"dropout": 0.1}
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"model": {"dropout": 0.3, "norm_first": True}}))
    assert resolve_settings(["--config", str(f), "--dropout", "0.1"]).model == {"dropout": 0.1, "norm_first": True}
    assert resolve_settings(["--model-arg", "num_heads=4", "--dropout", "0.2"]).model == {"num_heads": 4,
                                                                                         "dropout": 0.2}


# How every old name's note ends: when the old name goes (keras_transformer.renamed.REMOVED_IN).
READ_AS_SUCH = f"(read as such; the old name will be removed in keras-transformer {REMOVED_IN})"
LENGTH_PENALTY_KEY_NOTE = f'[kt-train] note: config key "alpha" is now "length_penalty" {READ_AS_SUCH}'
LENGTH_PENALTY_FLAG_NOTE = f"[kt-train] note: --alpha is now --length-penalty {READ_AS_SUCH}"


def test_length_penalty_is_read_from_its_old_config_key_and_flag_with_a_note(tmp_path, capsys):
    """kt-train's length penalty is `--length-penalty` / "length_penalty"; a --config file's "alpha" and the
    flag --alpha, its old names, still set it, each with a one-line note; both names at once are refused."""
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"length_penalty": 1.0}))
    cfg = resolve_settings(["--config", str(f)])
    assert cfg.length_penalty == 1.0 and "alpha" not in cfg.to_dict()
    assert resolve_settings(["--length-penalty", "0.9"]).length_penalty == 0.9
    assert "note" not in capsys.readouterr().out

    f.write_text(json.dumps({"alpha": 1.5, "beam_size": 5}))
    cfg = resolve_settings(["--config", str(f)])
    assert (cfg.length_penalty, cfg.beam_size) == (1.5, 5) and "alpha" not in cfg.to_dict()
    assert capsys.readouterr().err.splitlines() == [LENGTH_PENALTY_KEY_NOTE]
    assert resolve_settings(["--config", str(f), "--length-penalty", "0.7"]).length_penalty == 0.7  # flag beats file
    capsys.readouterr()

    cfg = resolve_settings(["--alpha", "0.8"])
    assert cfg.length_penalty == 0.8 and "alpha" not in cfg.to_dict() and "renamed_alpha" not in cfg.to_dict()
    assert capsys.readouterr().err.splitlines() == [LENGTH_PENALTY_FLAG_NOTE]

    with pytest.raises(SystemExit):
        resolve_settings(["--alpha", "0.8", "--length-penalty", "0.9"])
    assert "--alpha is the old name of --length-penalty: give --length-penalty only" in capsys.readouterr().err
    f.write_text(json.dumps({"alpha": 1.5, "length_penalty": 1.0}))
    with pytest.raises(SystemExit, match='config key "alpha" is the old name of "length_penalty": give '
                                         '"length_penalty" only'):
        resolve_settings(["--config", str(f)])


def test_the_training_pair_limit_is_max_sentence_length_its_old_key_and_flag_still_read_with_a_note(tmp_path, capsys):
    """kt-train's training-pair filter is `--max-sentence-length` / "max_sentence_length"; its old names, the flag
    --max-length and a --config file's "max_length", still set it, each with a one-line note; both at once are
    refused. (A "max_length" under "model" is the Transformer's own argument, not this setting.)"""
    assert resolve_settings(["--max-sentence-length", "64"]).max_sentence_length == 64
    assert "note" not in capsys.readouterr().err
    cfg = resolve_settings(["--max-length", "40"])
    assert cfg.max_sentence_length == 40 and "max_length" not in cfg.to_dict()
    assert capsys.readouterr().err.splitlines() == [
        f"[kt-train] note: --max-length is now --max-sentence-length {READ_AS_SUCH}"]
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"max_length": 256}))
    assert resolve_settings(["--config", str(f)]).max_sentence_length == 256
    assert capsys.readouterr().err.splitlines() == [
        f'[kt-train] note: config key "max_length" is now "max_sentence_length" {READ_AS_SUCH}']
    with pytest.raises(SystemExit):
        resolve_settings(["--max-length", "40", "--max-sentence-length", "50"])
    assert "--max-length is the old name of --max-sentence-length" in capsys.readouterr().err
    f.write_text(json.dumps({"max_length": 256, "max_sentence_length": 128}))
    with pytest.raises(SystemExit, match='"max_length" is the old name of "max_sentence_length"'):
        resolve_settings(["--config", str(f)])


def test_a_run_records_its_source_limit_as_max_source_length_and_an_older_runs_max_length_is_read():
    """config.json's "max_source_length" (kt-train's max_sentence_length) is the longest source kt-evaluate and
    the export translate; a run written before the name recorded it as "max_length"."""
    from common.run_dir import max_source_length

    assert max_source_length({"max_source_length": 96}) == 96
    assert max_source_length({"max_length": 64}) == 64
    assert max_source_length({}) is None


def test_every_setting_has_one_type_default_help_and_its_flags_in_the_one_dataclass(capsys):
    """`TrainSettings` is the one list of kt-train's settings: each field has a help and a group, each flag
    kt-train has sets one of them, --help shows every flag with the setting's default, and each field's default
    has the field's type."""
    from training.config import SETTINGS, TrainSettings, build_parser, flags_of, type_problem

    with pytest.raises(SystemExit):
        resolve_settings(["--help"])
    shown = capsys.readouterr().out
    parser_flags = {option for action in build_parser()._actions for option in action.option_strings}
    declared = {"-h", "--help", "--config", "--alpha", "--max-length"}  # the old names are hidden from --help
    for name, field in SETTINGS.items():
        assert field.metadata["help"] and field.metadata["group"], name
        assert type_problem(name, getattr(TrainSettings(), name)) is None, name
        for flag in flags_of(name):
            assert flag.name in shown, flag.name
            declared.add(flag.name)
    assert parser_flags == declared
    assert "--max-sentence-length N" in shown and "drop training pairs" in shown
    assert "--tokens-per-batch TOKENS_PER_BATCH" in shown and "(default: 4096)" in shown


def test_the_readme_settings_table_is_the_one_the_settings_make():
    """training/README.md's table of settings is `python -m training.config`'s output (regenerate it with that
    command when a setting changes)."""
    from training.config import settings_table

    readme = (REPO / "training" / "README.md").read_text(encoding="utf-8")
    start, end = "<!-- settings table: python -m training.config -->\n", "\n<!-- end of the settings table -->"
    assert start in readme and end in readme
    assert readme.split(start, 1)[1].split(end, 1)[0] == settings_table(), (
        "training/README.md's settings table is not TrainSettings': paste `python -m training.config`'s output "
        "between its markers")


def test_a_config_file_with_a_value_of_the_wrong_type_or_an_unknown_key_is_refused_naming_it(tmp_path):
    f = tmp_path / "c.json"
    for bad, words in (({"epochs": "10"}, '"epochs": expected int or null, got \'10\''),
                       ({"label_smoothing": True}, '"label_smoothing": expected float'),
                       ({"train_files": ["a.en"]}, '"train_files": expected a \\[SOURCE, TARGET\\] pair'),
                       ({"lowercase": "yes"}, '"lowercase": expected bool'),
                       ({"epoch": 3}, "unknown keys \\['epoch'\\]")):
        f.write_text(json.dumps(bad))
        with pytest.raises(SystemExit, match=words):
            resolve_settings(["--config", str(f)])
    f.write_text(json.dumps({"epochs": None, "max_updates": 10, "learning_rate_scale": 2, "mixed_precision": False,
                             "train_files": ["a.en", "a.de"]}))
    cfg = resolve_settings(["--config", str(f)])  # an int where a float goes is a float's value
    assert (cfg.epochs, cfg.learning_rate_scale, cfg.mixed_precision, cfg.dataset) == (None, 2, False, "files")


def test_kt_prepares_vocabulary_flags_are_kt_trains_with_the_same_defaults():
    from training.config import default
    from training.prepare import build_parser

    args = build_parser().parse_args(["--out", "x"])
    for name in ("vocab_size", "vocab_type", "vocab_sample", "lowercase", "seed"):
        assert getattr(args, name) == default(name), name


def test_kt_trains_help_shows_the_length_penalty_flag_not_its_old_name(capsys):
    with pytest.raises(SystemExit):
        resolve_settings(["--help"])
    out = capsys.readouterr().out
    assert "--length-penalty A" in out and "--alpha" not in out
    assert "--r-drop WEIGHT" in out and "--subword-sampling ALPHA" in out


def test_recorded_length_penalty_is_read_from_an_older_runs_alpha():
    """The commands after kt-train read config.json's "training": "length_penalty", or an older run's "alpha"."""
    from common.run_dir import recorded_setting

    assert recorded_setting({"training": {"length_penalty": 1.2}}, "length_penalty", None, 0.6) == 1.2
    assert recorded_setting({"training": {"alpha": 1.2}}, "length_penalty", None, 0.6) == 1.2
    assert recorded_setting({"training": {"alpha": 1.2}}, "length_penalty", 0.9, 0.6) == 0.9  # the flag wins
    assert recorded_setting({"training": {"alpha": None}}, "length_penalty", None, 0.6) == 0.6
    assert recorded_setting({}, "length_penalty", None, 0.6) == 0.6
    assert recorded_setting({"training": {"alpha": 1.2}}, "beam_size", None, 4) == 4


@pytest.mark.parametrize("make_vars, flag", [
    ([], None),                                              # the run's config.json decides
    (["LENGTH_PENALTY=0.9"], "--length-penalty 0.9"),
    (["ALPHA=0.8"], "--length-penalty 0.8"),                 # the old name, with a note
    (["LENGTH_PENALTY=0.9", "ALPHA=0.8"], "--length-penalty 0.9"),
])
def test_make_train_passes_length_penalty_or_its_old_name_alpha_to_kt_evaluate_and_kt_export(make_vars, flag):
    done = subprocess.run(["make", "-n", "train", "RUN=runs/lp", *make_vars], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.replace("\\\n", " ").splitlines()
    commands = [line for line in lines if "-m training.evaluate" in line or "-m export.export_model" in line]
    assert len(commands) == 2, done.stdout
    assert all((flag in line) if flag else ("--length-penalty" not in line) for line in commands), commands
    assert not any("--alpha" in line for line in commands)
    note = f'echo "make train: ALPHA is now LENGTH_PENALTY {READ_AS_SUCH}"'
    assert (note in lines) == any(v.startswith("ALPHA=") for v in make_vars), done.stdout


def test_design_md_is_the_one_list_of_the_old_names_and_says_when_they_go():
    """docs/design.md, "Names with one meaning, old names still read", lists every old name the project still
    reads: each old flag and config key of `RENAMED_SETTINGS`, each old keyword the library reads
    (`renamed_arguments`), make's ALPHA; and the release that removes them, `REMOVED_IN`, later than this one."""
    import re

    import keras_transformer as kt
    from common.run_dir import RENAMED_SETTINGS

    design = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    section = design.split("## Names with one meaning, old names still read\n", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    assert f"keras-transformer {REMOVED_IN}" in section
    version = [int(part) for part in kt.__version__.split(".")]
    assert [int(part) for part in REMOVED_IN.split(".")] > version
    old_names = {"`ALPHA`"}
    for old in RENAMED_SETTINGS:
        old_names |= {f"`--{old.replace('_', '-')}`", f'`"{old}"`'}
    library = "\n".join(path.read_text(encoding="utf-8") for path in (REPO / "keras_transformer").glob("*.py"))
    keywords = set(re.findall(r"renamed_arguments\((\w+)=", library))
    assert keywords >= {"max_length", "alpha"}
    old_names |= {f"{keyword}=" for keyword in keywords}  # `max_length=`, `MaskedRDropCrossentropy(alpha=)`
    assert [name for name in sorted(old_names) if name not in table] == []


def test_kt_export_takes_the_length_penalty_from_its_flag_its_old_flag_or_the_run(tmp_path, monkeypatch, capsys):
    """kt-export --length-penalty, else the length penalty kt-train recorded (an older run's "alpha" too), else
    0.6; its old flag --alpha still sets it, with a one-line note on stderr. (`export` itself is replaced: what
    reaches it is what the SavedModel is built with; tests/test_export_savedmodel.py exports for real.)"""
    import export.export_model as export_model
    from conftest import as_recorded_before_the_renames

    exported = []

    def fake_export(model_dir, export_dir, **kwargs):
        exported.append((kwargs["beam_size"], kwargs["length_penalty"]))
        return tmp_path / "exports" / "translator" / "1"

    monkeypatch.setattr(export_model, "export", fake_export)
    run, unrecorded = tmp_path / "run", tmp_path / "unrecorded"
    for folder, training in ((run, {"beam_size": 5, "length_penalty": 1.3}), (unrecorded, {})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"training": training}))
    old_run = as_recorded_before_the_renames(run, tmp_path / "old-run")
    common = ["--export-dir", str(tmp_path / "exports"), "--skip-op-check", "--parallel-loops", "1"]
    note = f"kt-export: --alpha is now --length-penalty {READ_AS_SUCH}"
    for folder, flags, expected in [(run, [], (5, 1.3)), (old_run, [], (5, 1.3)), (unrecorded, [], (4, 0.6)),
                                    (run, ["--length-penalty", "0.9"], (5, 0.9)),
                                    (old_run, ["--alpha", "0.8"], (5, 0.8))]:
        assert export_model.main(["--model-dir", str(folder), *common, *flags]) == 0
        assert exported.pop() == expected, (folder.name, flags)
        captured = capsys.readouterr()
        assert f"length penalty {expected[1]}" in captured.out
        assert (note in captured.err.splitlines()) == ("--alpha" in flags), captured.err
    with pytest.raises(SystemExit):
        export_model.main(["--model-dir", str(run), *common, "--alpha", "0.8", "--length-penalty", "0.9"])
    assert "--alpha is the old name of --length-penalty: give --length-penalty only" in capsys.readouterr().err
    assert not exported
    help_text = export_model.build_parser().format_help()
    assert "--length-penalty A" in help_text and "--alpha" not in help_text


@pytest.mark.parametrize("argv,scale", [([], 1.0), (["--learning-rate-scale", "2.5"], 2.5)])
def test_the_learning_rate_scale_reaches_the_optimizers_schedule(argv, scale):
    import keras_transformer as kt
    from training.fit import compile_model

    cfg = resolve_settings(["--preset", "tiny", "--warmup-steps", "200", *argv])
    model = kt.Transformer.from_preset("tiny", vocab_size=40)
    compile_model(model, cfg)
    schedule = model.optimizer.get_config()["learning_rate"]["config"]
    assert schedule == {"d_model": 32, "warmup_steps": 200, "scale": scale}


@pytest.mark.parametrize("argv, epsilon, clip", [
    ([], 1e-9, None),  # the paper's Adam, no clipping: the default is unchanged
    (["--adam-epsilon", "1e-8", "--global-clipnorm", "25"], 1e-8, 25.0),  # fairseq's defaults
])
def test_kt_trains_optimizer_has_the_configured_epsilon_and_global_clip(argv, epsilon, clip):
    import inspect

    from training.fit import build_and_compile
    from keras_transformer.distributed import UpdateStep

    cfg = resolve_settings(["--preset", "tiny", *argv])
    model = build_and_compile(cfg, 40)
    config = model.optimizer.get_config()
    assert config["epsilon"] == epsilon
    assert (config["beta_1"], config["beta_2"]) == (0.9, 0.98)
    # The clip is the training step's, on the gradient summed over replicas (tests/test_training_updates.py);
    # the optimizer clips nothing, which under tf.distribute would clip each replica's gradient apart.
    assert config["global_clipnorm"] is None and config["clipnorm"] is None
    step = inspect.unwrap(model.train_step)
    assert isinstance(step, UpdateStep) and step.global_clipnorm == clip


def test_settings_out_of_range_are_one_clear_error(tmp_path):
    from training.config import check_settings
    from training.errors import ConfigError

    check_settings(resolve_settings([]))
    for argv, words in ((["--adam-epsilon", "0"], "--adam-epsilon"), (["--global-clipnorm", "-1"], "--global-clipnorm"),
                        (["--max-updates", "0"], "--max-updates"), (["--average-last", "0"], "--average-last")):
        with pytest.raises(ConfigError, match=words):
            check_settings(resolve_settings(argv))
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"epochs": None}))
    with pytest.raises(ConfigError, match="needs max_updates"):
        check_settings(resolve_settings(["--config", str(f)]))
    check_settings(resolve_settings(["--config", str(f), "--max-updates", "10"]))


def test_shipped_best_recipe_is_the_anchors():
    """configs/multi30k-best.json: Wu et al. 2021's Transformer-Tiny recipe as fairseq runs it (the anchor), with the
    anchor's dropout 0.3, but for two settings chosen on val (training/README): pre-norm, where the anchor's
    post-norm left the model underfitting on CPU at dropout 0.3, and 8,000 joint pieces, where the anchor's 10,000
    overfit."""
    cfg = resolve_settings(["--config", str(REPO / "configs" / "multi30k-best.json")])
    assert cfg.vocab_size == 8000 and not cfg.tokenizer  # one joint vocabulary, trained by the run
    assert cfg.model == {"d_model": 128, "num_heads": 4, "d_ff": 256, "num_encoder_layers": 4,
                            "num_decoder_layers": 4, "dropout": 0.3, "norm_first": True}
    assert cfg.max_updates == 8060 and cfg.epochs is None and cfg.max_minutes is None
    assert (cfg.adam_epsilon, cfg.global_clipnorm, cfg.label_smoothing) == (1e-8, 25.0, 0.1)
    # Peak learning rate 0.005 at update 2,000: scale * (d_model * warmup) ** -0.5.
    assert cfg.warmup_steps == 2000
    assert cfg.learning_rate_scale * (128 * 2000) ** -0.5 == pytest.approx(0.005, rel=0.01)
    assert (cfg.average_last, cfg.beam_size, cfg.length_penalty) == (10, 5, 1.0)


@needs_multi30k
def test_mixed_precision_training(tmp_path):
    import keras
    import numpy as np

    import keras_transformer  # noqa: F401
    from training.fit import train

    src, tgt = (write_lines(tmp_path / f"s.{lang}", multi30k_lines(f"train.{lang}", 300)) for lang in ("en", "de"))
    cfg = resolve_settings(["--preset", "tiny", "--train-files", str(src), str(tgt), "--model-dir", str(tmp_path / "run"),
                          "--vocab-size", "500", "--tokens-per-batch", "400", "--max-sentence-length", "40", "--epochs", "1",
                          "--steps-per-epoch", "4", "--warmup-steps", "10", "--mixed-precision", "--no-validation",
                          "--verbose", "0"])
    summary = train(cfg)
    assert math.isfinite(summary["final_loss"]) and summary["optimizer_steps"] == 4
    assert keras.mixed_precision.global_policy().name == "float32"  # restored after training
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["dtype_policy"] == "mixed_bfloat16"
    model = keras.models.load_model(tmp_path / "run" / "model.keras", compile=False)
    assert model.dtype_policy.name == "mixed_bfloat16"
    assert all(w.dtype == "float32" for w in model.weights)
    ids = np.array([[5, 6, 7, 3]], "int32")
    assert model((ids, ids)).dtype == "float32"


def test_verbose_shows_logs_and_may_set_the_fit_verbosity():
    from common.native_logs import wants_logs

    assert resolve_settings(["--verbose"]).verbose == "auto" and wants_logs(["--verbose"])
    assert resolve_settings(["--verbose", "2"]).verbose == 2 and wants_logs(["--epochs", "1", "--verbose", "2"])
    assert resolve_settings([]).verbose == "auto" and not wants_logs(["--epochs", "1"])


def test_shipped_multi30k_recipe_is_defined_by_work_not_wall_time():
    """22 epochs on any machine: no time budget, so a slow CPU trains the same model, only longer."""
    cfg = resolve_settings(["--config", str(REPO / "configs" / "multi30k.json")])
    assert cfg.preset == "small" and cfg.mixed_precision == "auto"
    assert cfg.epochs == 22 and cfg.max_minutes is None and cfg.steps_per_epoch is None
    assert cfg.model["dropout"] == 0.2 and cfg.label_smoothing == 0.1
    assert (cfg.average_last, cfg.beam_size, cfg.length_penalty) == (5, 4, 1.0)  # what `make train` always ran
    assert cfg.adam_epsilon is None and cfg.global_clipnorm is None and cfg.max_updates is None


@needs_multi30k
def test_time_budget_stops_after_a_whole_epoch(tmp_path):
    from training.fit import train

    src, tgt = (write_lines(tmp_path / f"s.{lang}", multi30k_lines(f"train.{lang}", 200)) for lang in ("en", "de"))
    common = ["--preset", "tiny", "--train-files", str(src), str(tgt), "--vocab-size", "400",
              "--tokens-per-batch", "400", "--epochs", "3", "--steps-per-epoch", "2", "--warmup-steps", "10",
              "--no-validation", "--verbose", "0"]
    # A budget far shorter than one epoch: the first epoch still completes (and is checkpointed), then it stops.
    summary = train(resolve_settings(common + ["--model-dir", str(tmp_path / "short"), "--max-minutes", "1e-6"]))
    assert summary["epochs_run"] == [1] and summary["stopped_by_time_budget"]
    assert summary["optimizer_steps"] == 2
    assert sorted(p.name for p in (tmp_path / "short" / "checkpoints").iterdir()) == ["epoch-001.weights.h5"]
    assert (tmp_path / "short" / "model.keras").exists()
    # A generous budget changes nothing.
    summary = train(resolve_settings(common + ["--model-dir", str(tmp_path / "long"), "--max-minutes", "60"]))
    assert summary["epochs_run"] == [1, 2, 3] and not summary["stopped_by_time_budget"]


@needs_multi30k
def test_lowercase_trains_a_case_folding_vocabulary_and_config_json_says_what_the_vocabulary_does(tmp_path, capsys):
    from keras_transformer.text import lowercases, read_tokenizer_proto
    from training.errors import ConfigError
    from training.fit import train

    def run(name, *flags):
        train(resolve_settings(two_batch_epochs_args(tmp_path, tmp_path / name) + ["--epochs", "1", *flags]))
        recorded = json.loads((tmp_path / name / "config.json").read_text())["training"]["lowercase"]
        return lowercases(read_tokenizer_proto(tmp_path / name / "tokenizer.model")), recorded

    assert run("cased") == (False, False)
    assert "case-folding" not in capsys.readouterr().out
    assert run("folding", "--lowercase") == (True, True)
    assert "case-folding: the model reads and writes lowercase text" in capsys.readouterr().out
    # A case-folding --tokenizer without --lowercase: config.json records what the vocabulary does.
    assert run("given", "--tokenizer", str(tmp_path / "folding" / "tokenizer.model")) == (True, True)
    # --lowercase with a cased vocabulary, given or the run's own, is refused before anything is trained.
    cased = tmp_path / "cased" / "tokenizer.model"
    with pytest.raises(ConfigError, match=r"--lowercase .*asks for a case-folding vocabulary, but the vocabulary "
                       rf"{cased} is cased: drop --lowercase"):
        run("refused", "--lowercase", "--tokenizer", str(cased))
    assert not (tmp_path / "refused" / "checkpoints").exists()
    (tmp_path / "resumed").mkdir()
    (tmp_path / "resumed" / "tokenizer.model").write_bytes(cased.read_bytes())
    with pytest.raises(ConfigError, match=r"but this run's vocabulary .* is cased"):
        run("resumed", "--lowercase")


@needs_multi30k
def test_training_into_a_finished_run_is_refused_and_leaves_it_whole(tmp_path):
    from training.errors import ConfigError
    from training.fit import train

    run = tmp_path / "run"
    args = two_batch_epochs_args(tmp_path, run)
    train(resolve_settings(args + ["--epochs", "2"]))
    finished = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    # Its backup is gone, so a second run would start at epoch 1 over the first one's files; a bound it has
    # already reached has nothing to continue.
    for bound, asked in ((["--epochs", "2"], "--epochs 2"), (["--epochs", "1"], "--epochs 1"),
                         (["--epochs", "3", "--max-updates", "4"], "--max-updates 4 and --epochs 3")):
        with pytest.raises(ConfigError, match=r"holds a finished run \(.*model.keras; it made 4 updates in 2 epochs\)\. "
                           rf"This run \({asked}\) would not go past it.*run again with --max-updates above 4 "
                           r"\(and --epochs, if set, above 2;.*--init-from"):
            train(resolve_settings(args + bound))
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == finished


@needs_multi30k
def test_a_finished_run_continues_from_its_last_state_to_a_larger_bound(tmp_path, capsys):
    """fairseq's behaviour when --max-update is raised: the run goes on from where it stopped, optimizer included."""
    import keras

    from training.callbacks import ResumableBackup
    from training.fit import build_and_compile, continue_finished_run, train

    run = tmp_path / "run"
    args = two_batch_epochs_args(tmp_path, run)
    # 3 updates: epoch 1, then 1 update into epoch 2 (its checkpoint is written as the update bound stops it).
    first = train(resolve_settings(args + ["--max-updates", "3"]))
    assert first["optimizer_steps"] == 3 and first["epochs_run"] == [1, 2]

    # The backup it continues from holds the finished run's weights and optimizer state, every variable of them.
    cfg = resolve_settings(args + ["--max-updates", "6"])
    continue_finished_run(cfg, run, run)
    assert "finished at update 3 (epoch 2): continuing it from epoch-002.weights.h5" in capsys.readouterr().out
    finished = keras.models.load_model(run / "model.keras", compile=True)
    vocab_size = json.loads((run / "config.json").read_text())["vocab_size"]
    fresh = build_and_compile(cfg, vocab_size)
    backup = ResumableBackup(run / "backup")
    backup.set_model(fresh)
    assert backup.load_backup(backup.weights_path, backup.metadata_path) == {"epoch": 2, "batch": 0, "step": 3}
    for name, mine, theirs in (("weights", fresh.weights, finished.weights),
                               ("optimizer", fresh.optimizer.variables, finished.optimizer.variables)):
        assert len(mine) == len(theirs) > 0, name
        for a, b in zip(mine, theirs):
            assert keras.ops.convert_to_numpy(a).tolist() == keras.ops.convert_to_numpy(b).tolist(), (name, a.path)
    assert int(keras.ops.convert_to_numpy(fresh.optimizer.iterations)) == 3

    # The run then goes on to the new bound as a run bounded there from the start: the rest of epoch 2, where the
    # bound stopped it (its checkpoint written again, whole, and a second history row), then epoch 3.
    summary = train(cfg)
    assert summary["resumed_from"] == {"epoch": 2, "batch": 0, "step": 3}
    assert summary["optimizer_steps"] == 6 and summary["epochs_run"] == [2, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        f"epoch-00{e}.weights.h5" for e in (1, 2, 3)]
    assert [row["epoch"] for row in history_rows(run)] == ["0", "1", "1", "2"]
    assert not (run / "backup").exists() and not (run / "backup.continue").exists()
    assert json.loads((run / "config.json").read_text())["last_run"]["optimizer_steps"] == 6


@needs_multi30k
def test_epochs_of_one_pass_train_on_all_batches_without_a_warning(tmp_path):
    from training.fit import train

    src, tgt = (write_lines(tmp_path / f"s.{lang}", multi30k_lines(f"train.{lang}", 200)) for lang in ("en", "de"))
    # --max-train-examples keeps kt-train on the text (a prepared corpus's epoch is a count, not a pass).
    cfg = resolve_settings(["--preset", "tiny", "--train-files", str(src), str(tgt), "--vocab-size", "400",
                          "--tokens-per-batch", "600", "--epochs", "2", "--warmup-steps", "10", "--no-validation",
                          "--verbose", "0", "--model-dir", str(tmp_path / "run"), "--max-train-examples", "200"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = train(cfg)
    # Bucketed batches have no known count: Keras learns it by running out of data in epoch 1.
    assert not [w for w in caught if "ran out of data" in str(w.message)]
    assert summary["epochs_run"] == [1, 2]
    # Two passes make two updates per batch of a pass, and no more (no_step_without_data: the test above).
    batches = json.loads((tmp_path / "run" / "config.json").read_text())["batches"]["batches"]
    assert batches >= 2 and summary["optimizer_steps"] == 2 * batches


@pytest.mark.filterwarnings("ignore:Your input ran out of data")  # how Keras learns an epoch's length, here too
@pytest.mark.parametrize("accumulate", [None, 3])
def test_an_epoch_of_unknown_length_makes_the_updates_of_one_of_known_length(accumulate):
    """Keras 3.15's TensorFlow trainer ends an epoch of unknown length (bucketed batches' length is unknown) with a
    step whose batch never comes, and the step's ops that do not read the batch run: the optimizer's step counter
    gains one, with no update, and with accumulation the summed gradients are reset
    (keras_transformer/keras_internals.py). The learning rate follows that counter, so the run drifts from one on the same
    batches of known length. With `no_step_without_data`, as kt-train runs fit(), the two runs are one; so they are
    when the dataset is told its length, as docs/library.md advises users of their own fit()."""
    import keras
    import numpy as np
    import tensorflow as tf

    from keras_transformer.keras_internals import no_step_without_data

    rng = np.random.default_rng(0)
    x, y = rng.random((50, 4), dtype="float32"), rng.random((50, 1), dtype="float32")
    known = tf.data.Dataset.from_tensor_slices((x, y)).batch(10)  # 5 batches
    unknown = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(10)  # the same, length unknown
    assert known.cardinality() == 5 and unknown.cardinality() == tf.data.UNKNOWN_CARDINALITY

    def fit(data, fixed=False):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.9)
        model.compile(keras.optimizers.SGD(schedule, gradient_accumulation_steps=accumulate), "mse")
        if fixed:
            no_step_without_data(model)
        model.fit(data, epochs=3, verbose=0, shuffle=False)
        return int(model.optimizer.iterations.numpy()), model.get_weights()

    steps, weights = fit(known)
    assert steps == 15 // (accumulate or 1)
    # kt-train's fix, and what docs/library.md tells users of their own fit(): give the dataset its length.
    told = unknown.apply(tf.data.experimental.assert_cardinality(known.cardinality()))
    for how, data, fixed in (("no_step_without_data", unknown, True), ("assert_cardinality", told, False)):
        same_steps, same_weights = fit(data, fixed)
        assert same_steps == steps, how
        for same, expected in zip(same_weights, weights):
            np.testing.assert_array_equal(same, expected, err_msg=how)
    # Keras' own run. Should this fail after a Keras upgrade, Keras no longer runs the step without its batch, and
    # no_step_without_data can go.
    _, drifted_weights = fit(unknown)
    assert not np.array_equal(drifted_weights[0], weights[0])


EPYC_AVX2 = "fpu sse2 avx avx2 fma f16c bmi2"  # an AVX2-only EPYC: bfloat16 is emulated there (0.84x float32)
EPYC_BF16 = EPYC_AVX2 + " avx512f avx512bw avx512_bf16 avx512_vnni"
SAPPHIRE_RAPIDS = EPYC_AVX2 + " avx512f amx_tile amx_bf16 amx_int8"


@pytest.mark.parametrize("flags, gpus, policy", [
    (EPYC_AVX2, [], "float32"),
    (EPYC_BF16, [], "mixed_bfloat16"),
    (SAPPHIRE_RAPIDS, [], "mixed_bfloat16"),
    (EPYC_AVX2, [(8, 0)], "mixed_bfloat16"),
    (EPYC_AVX2, [(7, 5), (8, 6)], "mixed_float16"),
    (EPYC_BF16, [(6, 1)], "float32"),
])
def test_auto_precision_follows_the_hardware(flags, gpus, policy):
    from training.precision import choose_policy

    chosen, reason = choose_policy("auto", flags=flags.split(), gpu_capabilities=gpus)
    assert chosen == policy and reason


def test_precision_flags_force_either_way(tmp_path):
    from keras_transformer.hardware import cpu_flags
    from training.precision import choose_policy

    assert resolve_settings([]).mixed_precision == "auto"
    assert resolve_settings(["--mixed-precision"]).mixed_precision is True
    assert resolve_settings(["--config", str(REPO / "configs" / "multi30k.json"),
                             "--no-mixed-precision"]).mixed_precision is False
    assert choose_policy(True, flags=EPYC_AVX2.split(), gpu_capabilities=[])[0] == "mixed_bfloat16"
    assert choose_policy(True, flags=EPYC_AVX2.split(), gpu_capabilities=[(7, 0)])[0] == "mixed_float16"
    assert choose_policy(False, flags=EPYC_BF16.split(), gpu_capabilities=[(8, 0)])[0] == "float32"
    with pytest.raises(ValueError, match="mixed_precision"):
        choose_policy("yes", flags=[], gpu_capabilities=[])
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu avx2 avx512_bf16\n")
    assert cpu_flags(cpuinfo) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(tmp_path / "missing") == set()


def _run_epochs(eta, now, epochs, optimizer=None):
    """Drive `eta` through `epochs`, [(0-based epoch, seconds it takes, updates it makes)], on the clock `now`."""
    for epoch, seconds, updates in epochs:
        eta.on_epoch_begin(epoch)
        now[0] += seconds
        if optimizer is not None:
            optimizer.iterations += updates
        eta.on_epoch_end(epoch)


def test_every_epoch_says_the_time_so_far_and_the_time_left(capsys):
    """The estimate is the median time of the recent epochs times the epochs left; a resumed run counts from its
    first; the process's first epoch (it traces) and a stalled epoch (a paused or crowded run) do not set it."""
    from training.callbacks import EpochETA

    now = [100.0]
    eta = EpochETA(epochs=10, clock=lambda: now[0])
    eta.on_train_begin()
    # Resumed at epoch 4 (0-based 3): a first epoch of 1 minute, then 2 minutes each, and one of 16.
    _run_epochs(eta, now, [(3, 60.0, 0), (4, 120.0, 0), (5, 120.0, 0), (6, 960.0, 0), (7, 120.0, 0)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[kt-train] epoch 4/10 done: 1.0 min so far, about 6.0 min left (ends around ")
    assert lines[1].startswith("[kt-train] epoch 5/10 done: 3.0 min so far, about 10.0 min left (ends around ")
    assert "epoch 7/10 done: 21.0 min so far, about 6.0 min left" in lines[3]  # the median of 2, 2 and 16 minutes
    assert "epoch 8/10 done: 23.0 min so far, about 4.0 min left" in lines[4]
    budget = EpochETA(epochs=10, max_minutes=5, clock=lambda: now[0])  # a time budget caps the estimate
    budget.on_train_begin()
    _run_epochs(budget, now, [(0, 60.0, 0)])
    assert "1.0 min so far, about 4.0 min left" in capsys.readouterr().out


def test_the_time_left_to_an_update_count_is_the_recent_time_per_update(capsys):
    """With `max_updates` the estimate is the recent epochs' median time per update times the updates left,
    where that ends before the epochs do; the first epoch's tracing time is left out."""
    from types import SimpleNamespace

    from training.callbacks import EpochETA

    now, optimizer = [0.0], SimpleNamespace(iterations=0)
    eta = EpochETA(epochs=100, max_updates=250, clock=lambda: now[0])
    eta.set_model(SimpleNamespace(optimizer=optimizer))
    eta.on_train_begin()
    # 50 updates an epoch: the first takes 5 minutes (tracing), the next 1 minute each.
    _run_epochs(eta, now, [(0, 300.0, 50), (1, 60.0, 50), (2, 60.0, 50)], optimizer)
    lines = capsys.readouterr().out.splitlines()
    assert "epoch 1/100 (update 50/250) done: 5.0 min so far, about 20.0 min left" in lines[0]
    assert "epoch 3/100 (update 150/250) done: 7.0 min so far, about 2.0 min left" in lines[2]
    with pytest.raises(ValueError, match="window must be >= 1"):
        EpochETA(epochs=10, window=0)


def test_progress_bar_on_a_terminal_one_line_per_epoch_in_a_file(tmp_path):
    import io

    from training.fit import fit_verbosity

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert fit_verbosity("auto", Terminal()) == 1
    with open(tmp_path / "log", "w") as log:
        assert fit_verbosity("auto", log) == 2
    assert fit_verbosity(0, Terminal()) == 0


@needs_multi30k
def test_kt_train_keeps_tensorflow_and_absl_log_lines_out_unless_verbose(tmp_path):
    """TensorFlow's C++ start-up lines (oneDNN, CUDA probe), TFDS' absl INFO lines and Python logging's INFO
    lines are hidden; `--verbose` shows them. kt-train's own lines, the tokenizer's among them, are there
    either way."""
    args = [sys.executable, "-m", "training.train", "--preset", "tiny", "--data-dir", str(MULTI30K),
            "--epochs", "1", "--steps-per-epoch", "1", "--max-train-examples", "300", "--max-eval-examples", "20",
            "--vocab-size", "500", "--no-validation"]
    noise = ("oneDNN custom operations", "cuda", " INFO ", "I0000")
    quiet = subprocess.run(args + ["--model-dir", str(tmp_path / "quiet")], cwd=REPO,
                           env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=600)
    assert quiet.returncode == 0, quiet.stderr
    output = quiet.stdout + quiet.stderr
    assert "[kt-train] done" in output and not [n for n in noise if n in output], output
    assert "[kt-train] tokenizer: " in output and "lines of training text, both sides" in output, output
    loud = subprocess.run(args + ["--model-dir", str(tmp_path / "loud"), "--verbose"], cwd=REPO,
                          env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=600)
    assert loud.returncode == 0, loud.stderr
    loud_output = loud.stdout + loud.stderr
    assert "absl INFO" in loud_output and "training.distribute INFO" in loud_output, loud_output
    assert "[kt-train] done" in loud_output


@pytest.mark.parametrize("command", ["training.evaluate", "training.average_checkpoints", "export.export_model"])
def test_the_other_commands_keep_tensorflow_start_up_lines_out_unless_verbose(command, tmp_path):
    """kt-evaluate, kt-average-checkpoints and kt-export: a bad --model-dir gets one clear line, with no
    TensorFlow start-up lines around it; --verbose shows them."""
    args = [sys.executable, "-m", command, "--model-dir", str(tmp_path / "missing")]
    args += ["--export-dir", str(tmp_path / "exports")] if command == "export.export_model" else []
    quiet = subprocess.run(args, cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 2 and "config.json not found" in quiet.stderr, quiet.stderr
    assert "oneDNN" not in quiet.stderr and "I0000" not in quiet.stderr and "Traceback" not in quiet.stderr
    loud = subprocess.run(args + ["--verbose"], cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True,
                          timeout=300)
    # oneDNN announces itself only on CPUs where TensorFlow turns it on (AVX-512 ones), the CUDA probe's I0000
    # lines on every CPU-only machine.
    assert "config.json not found" in loud.stderr
    assert "oneDNN custom operations" in loud.stderr or "I0000" in loud.stderr, loud.stderr


def test_the_test_suite_prints_no_tensorflow_start_up_lines():
    """conftest imports TensorFlow as the commands do, so a pytest run on TensorFlow with xdist workers, as
    `make test` runs it, prints no start-up line of TensorFlow's C++ (they came at the end of every CI log)."""
    args = [sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "no:cacheprovider", "tests/test_layout.py",
            "-k", "test_no_measured_figure_in_code"]
    proc = subprocess.run(args, cwd=REPO, env={**COMMAND_ENV, "KERAS_BACKEND": "tensorflow"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not TF_LOG_LINE.search(proc.stdout + proc.stderr), proc.stderr[-3000:]


def test_kt_evaluate_prints_no_tensorflow_log_lines(quick_model_dir):
    """TensorFlow logs as it reads a split (tf.data's INFO and WARNING lines) and as a search first runs (an
    ERROR-level line from oneDNN's graph rewrite that is no error). kt-evaluate hides them itself, not only when
    the user has set TF_CPP_MIN_LOG_LEVEL. (`--verbose`: the test above; kt-translate:
    tests/test_export_clients.py; a user's own level: the test below.)"""
    args = [sys.executable, "-m", "training.evaluate", "--model-dir", str(quick_model_dir), "--dataset", "multi30k",
            "--data-dir", str(MULTI30K), "--split", "val", "--max-examples", "8", "--batch-size", "4",
            "--no-progress", "--output", "/dev/null"]
    proc = subprocess.run(args, cwd=REPO, env=COMMAND_ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Decoded 8 sentences" in proc.stdout, proc.stderr[-3000:]
    assert not TF_LOG_LINE.search(proc.stderr), proc.stderr[-3000:]


@pytest.mark.parametrize("argv, user_level, level", [
    (["kt-evaluate"], None, "3"),                  # a command hides TensorFlow's C++ log lines
    (["kt-evaluate"], "0", "0"),                   # a level the user set wins
    (["kt-evaluate", "--verbose"], None, None),    # --verbose leaves TensorFlow's own default: every line
    (["kt-train", "--verbose", "2"], None, None),
])
def test_commands_set_tensorflows_log_level_before_it_loads(argv, user_level, level, monkeypatch):
    """What `quiet_import_for_commands` leaves in TF_CPP_MIN_LOG_LEVEL, which TensorFlow reads as it loads."""
    import common.native_logs as native_logs

    monkeypatch.setattr(native_logs, "import_tensorflow_quietly", lambda enabled: None)
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    if user_level is not None:
        monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", user_level)
    native_logs.quiet_import_for_commands("__main__")
    assert os.environ.get("TF_CPP_MIN_LOG_LEVEL") == level


@pytest.mark.parametrize("user_setting, on", [(None, True), ("0", False)])
def test_kt_train_turns_onednn_on_unless_the_user_turns_it_off(user_setting, on):
    """TensorFlow leaves its oneDNN kernels off on AVX2-only CPUs, where training is then far slower
    (BENCHMARKS.md): kt-train turns them on on every CPU, and TF_ENABLE_ONEDNN_OPTS=0 still wins."""
    env = {k: v for k, v in SUBPROCESS_ENV.items() if k != ONEDNN_ENV}
    env["TF_CPP_MIN_LOG_LEVEL"] = "0"  # TensorFlow says at INFO level, as it loads, whether oneDNN is on
    if user_setting is not None:
        env[ONEDNN_ENV] = user_setting
    proc = subprocess.run([sys.executable, "-c", "import training.train"], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("oneDNN custom operations are on" in proc.stderr) == on, proc.stderr[-3000:]


@needs_multi30k
def test_r_drop_compiles_its_loss_records_its_weight_and_validates_with_the_plain_loss(tmp_path, capsys):
    """kt-train --r-drop WEIGHT: R-Drop's loss in training, the weight in config.json, and a validation loss (the
    batches hold each pair twice, and without dropout the KL is 0) equal to the plain loss on single pairs."""
    import keras

    import keras_transformer as kt
    from common.tokenizer import make_tokenizer
    from keras_transformer.text import read_tokenizer_proto
    from training.config import check_settings
    from keras_transformer.distributed import UpdateStep
    from training.errors import ConfigError
    from training.data import load_text_pairs
    from training.fit import compile_model, data_spec, train
    from training.keras_internals import ignoring_ran_out_of_data
    from training.pipeline import make_batches

    with pytest.raises(ConfigError, match="--r-drop"):
        check_settings(resolve_settings(["--r-drop", "-1"]))
    model = kt.Transformer.from_preset("tiny", vocab_size=40)
    compile_model(model, resolve_settings(["--r-drop", "2.5", "--label-smoothing", "0.2"]))
    assert type(model.loss) is kt.MaskedRDropCrossentropy
    assert (model.loss.kl_weight, model.loss.label_smoothing) == (2.5, 0.2)

    run = tmp_path / "run"
    val = [write_lines(tmp_path / f"v.{lang}", multi30k_lines(f"val.{lang}", 60)) for lang in ("en", "de")]
    argv = [a for a in two_batch_epochs_args(tmp_path, run) if a != "--no-validation"]
    cfg = resolve_settings(argv + ["--epochs", "2", "--valid-files", *map(str, val), "--no-mixed-precision",
                                 "--model-arg", "dropout=0.3", "--r-drop", "5"])
    train(cfg)
    assert "R-Drop: each sentence twice in its batch" in capsys.readouterr().out
    assert json.loads((run / "config.json").read_text())["training"]["r_drop"] == 5.0
    val_loss = float(history_rows(run)[-1]["val_loss"])
    model = keras.models.load_model(run / "model.keras")
    model.compile(loss=kt.MaskedSparseCategoricalCrossentropy(label_smoothing=0.1))
    UpdateStep.install(model)  # evaluate() counts the loss as kt-train's does: the mean over the real tokens
    tokenizer = make_tokenizer(read_tokenizer_proto(run / "tokenizer.model"))
    single = make_batches(load_text_pairs(data_spec(cfg), "validation"), tokenizer, max_sentence_length=128,
                          tokens_per_batch=400, shuffle=False)
    with ignoring_ran_out_of_data():  # bucketed batches, as in kt-train
        single_loss = model.evaluate(single, verbose=0, return_dict=True)["loss"]
    assert single_loss == pytest.approx(val_loss, rel=1e-5)


@needs_multi30k
def test_a_run_by_updates_checkpoints_validates_and_averages_every_n_updates(tmp_path, capsys):
    """--checkpoint-every 3 --max-updates 10 with 2 batches per update: a checkpoint named by its update after
    updates 3, 6 and 9 and at the end (10), a history.csv row with a validation loss for each span of 3 updates,
    and kt-average-checkpoints --last 2 averaging the last two update checkpoints (--best refused: it ranks
    epochs)."""
    import keras
    import numpy as np

    from training.average_checkpoints import main as average
    from training.fit import train

    run = tmp_path / "run"
    args = two_batch_epochs_args(tmp_path, run)
    for flag in ("--steps-per-epoch", "--no-validation"):
        i = args.index(flag)
        del args[i:i + (2 if flag == "--steps-per-epoch" else 1)]
    valid = [str(write_lines(tmp_path / f"v.{lang}", multi30k_lines(f"val.{lang}", 20))) for lang in ("en", "de")]
    summary = train(resolve_settings(args + ["--valid-files", *valid, "--grad-accum", "2", "--checkpoint-every", "3",
                                           "--max-updates", "10"]))
    assert summary["optimizer_steps"] == 10 and summary["stopped_by_max_updates"]
    assert "a checkpoint and the validation every 3 updates (--checkpoint-every)" in capsys.readouterr().out
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert checkpoints == [f"update-{u:07d}.weights.h5" for u in (3, 6, 9, 10)]
    rows = history_rows(run)
    assert len(rows) == 4 and all(float(row["val_loss"]) > 0 for row in rows)

    out = tmp_path / "avg.keras"
    assert average(["--model-dir", str(run), "--last", "2", "--output", str(out)]) == 0
    assert "update-0000009.weights.h5, update-0000010.weights.h5 ->" in capsys.readouterr().out
    model = keras.models.load_model(run / "model.keras", compile=False)
    last_two = []
    for u in (9, 10):
        model.load_weights(run / "checkpoints" / f"update-{u:07d}.weights.h5")
        last_two.append(model.get_weights())
    assert max(float(np.abs(a - b).max()) for a, b in zip(*last_two)) > 0  # the two checkpoints differ
    for a, b, m in zip(*last_two, keras.models.load_model(out, compile=False).get_weights()):
        np.testing.assert_allclose(m, (a.astype(np.float64) + b) / 2, rtol=1e-6, atol=1e-7)
    assert average(["--model-dir", str(run), "--best", "2"]) == 2
    assert "--best ranks epoch checkpoints" in capsys.readouterr().err


def test_a_run_by_updates_needs_its_length_in_updates():
    from training.config import check_settings
    from training.errors import ConfigError

    with pytest.raises(ConfigError, match="--max-updates N"):
        check_settings(resolve_settings(["--checkpoint-every", "100"]))
    with pytest.raises(ConfigError, match="drop --steps-per-epoch"):
        check_settings(resolve_settings(["--checkpoint-every", "100", "--max-updates", "1000", "--steps-per-epoch", "5"]))
    with pytest.raises(ConfigError, match="--checkpoint-every"):
        check_settings(resolve_settings(["--checkpoint-every", "0", "--max-updates", "1000"]))
