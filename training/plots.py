"""Figures of a run: learning-rate schedule, loss curves, attention heatmaps.

    python -m training.plots schedule --out docs/images/lr_schedule.png [--model-dir RUN]
    python -m training.plots loss --model-dir RUN --out docs/images/loss.png
    python -m training.plots attention --model-dir RUN --out docs/images/attention.png \
        --source "A man in an orange hat starring at something."

`schedule` draws `kt.TransformerSchedule` (paper section 5.3, equation 3) for
the paper's base model (d_model 512, 4,000 warm-up steps) and for a second
setting: the run's d_model and --warmup-steps from RUN/config.json, else
--d-model/--warmup-steps. `loss` draws the training and validation loss per
epoch from RUN/history.csv. `attention` translates one sentence greedily and
draws the last layer's encoder self-attention and decoder cross-attention
(softmax weights averaged over the heads, or one panel per head with
--per-head), with the sentencepiece pieces as tick labels.

Needs matplotlib (`pip install -e ".[plots]"`); draws with the Agg backend,
so no display is needed. Each command writes one PNG.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np

from common.native_logs import quiet_import_for_commands

# Before TensorFlow is imported: as a command, its C++ log lines stay out of the terminal (common/native_logs.py).
quiet_import_for_commands(__name__)

import tensorflow as tf  # noqa: E402

import keras_transformer as kt  # noqa: E402
from common.run_dir import load_model_dir, max_source_length, read_config  # noqa: E402
from keras_transformer.text import END_ID, PAD_ID, START_ID  # noqa: E402
from common.tokenizer import decode_output, encode_source, source_side, target_side  # noqa: E402

PAPER_D_MODEL, PAPER_WARMUP_STEPS = 512, 4000
DPI = 150


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or a clear error without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit('training.plots needs matplotlib: pip install -e ".[plots]"') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI, bbox_inches="tight")
    _pyplot().close(fig)
    print(f"wrote {out}")
    return out


# ---------------------------------------------------------------- schedule


def schedule_settings(args) -> tuple[int, int, float, int | None]:
    """(d_model, warmup_steps, learning-rate scale, optimizer steps run or None) for the second curve."""
    if not args.model_dir:
        return args.d_model, args.warmup_steps, 1.0, None
    cfg = read_config(args.model_dir)
    steps_run = cfg.get("last_run", {}).get("optimizer_steps")
    # Runs from before the scale existed trained with the paper's curve.
    scale = cfg["training"].get("learning_rate_scale", 1.0)
    return cfg["model_config"]["d_model"], cfg["training"]["warmup_steps"], scale, steps_run


def _preset_of(d_model) -> str:
    return next((f"{name} preset" for name, p in kt.PRESETS.items() if p["d_model"] == d_model), "compared")


def plot_schedule(args) -> Path:
    d_model, warmup, scale, steps_run = schedule_settings(args)
    curves = [(PAPER_D_MODEL, PAPER_WARMUP_STEPS, 1.0, "paper base")]
    if (d_model, warmup, scale) != (PAPER_D_MODEL, PAPER_WARMUP_STEPS, 1.0):
        curves.append((d_model, warmup, scale, "this run" if args.model_dir else _preset_of(d_model)))
    # Wide enough to show the decay after the longest warm-up and the whole run.
    last = args.steps or max(5 * max(w for _, w, _, _ in curves), steps_run or 0)
    steps = np.arange(1, last + 1)

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for d, w, scale, name in curves:
        lr = np.asarray(kt.TransformerSchedule(d, w, scale)(steps))
        scaled = "" if scale == 1.0 else f", scale {scale:g}"
        ax.plot(steps, lr, label=f"{name}: d_model {d}, warm-up {w:,}{scaled} (peak {lr.max():.2e})")
    if steps_run:
        ax.axvline(steps_run, color="gray", linestyle="--", linewidth=1, label=f"end of the run ({steps_run:,} steps)")
    ax.set(title="Learning rate: scale · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5)",
           xlabel="optimizer step", ylabel="learning rate", xlim=(0, last), ylim=(0, None))
    ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, args.out)


# -------------------------------------------------------------------- loss


def read_history(path) -> dict[str, list[tuple[int, float]]]:
    """history.csv (Keras' CSVLogger) -> {column: [(epoch, value), ...]}, epochs counted from 1.

    A resumed run appends to the file and may repeat an epoch; the last row of
    an epoch wins. Empty cells (no validation) are left out.
    """
    rows = {}
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if row.get("epoch", "").isdigit():  # only epoch rows (not a stray header or a blank line)
                rows[int(row["epoch"]) + 1] = row
    columns = {}
    for epoch in sorted(rows):
        for key, value in rows[epoch].items():
            if key != "epoch" and value not in (None, ""):
                columns.setdefault(key, []).append((epoch, float(value)))
    return columns


def plot_loss(args) -> Path:
    path = Path(args.model_dir) / "history.csv"
    if not path.is_file():
        raise SystemExit(f"{path} not found: is {args.model_dir} a directory written by kt-train?")
    history = read_history(path)
    if "loss" not in history:
        raise SystemExit(f"{path} has no loss column")
    smoothing = _label_smoothing(args.model_dir)

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label, style in (("loss", "training", "o-"), ("val_loss", "validation", "s-")):
        if key in history:
            epochs, values = zip(*history[key])
            ax.plot(epochs, values, style, label=label)
    ax.set(title=f"Loss per epoch ({Path(args.model_dir).name})", xlabel="epoch",
           ylabel="cross-entropy per token" + (f" (label smoothing {smoothing})" if smoothing else ""))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, args.out)


def _label_smoothing(model_dir):
    """The run's label smoothing (it raises the loss floor above 0), if config.json has it."""
    try:
        return read_config(model_dir).get("training", {}).get("label_smoothing")
    except FileNotFoundError:
        return None


# --------------------------------------------------------------- attention


def translate_with_attention(model, tokenizer, config, text, max_output_length=None):
    """Greedy translation of `text` and the attention weights of that translation.

    Returns (source pieces, output pieces, translation, weights). The decoder
    input is [start] + output[:-1], so query row t is the position that
    produced output piece t (the end piece included). `weights` is
    `Transformer.attention_scores` for the one sentence (batch of 1).
    """
    source = encode_source(tokenizer, tf.constant([text]), max_source_length(config)).to_tensor(PAD_ID)
    tokens, _ = kt.greedy_decode(model, source, START_ID, END_ID, max_output_length=max_output_length)
    output = [t for t in tokens[0].numpy().tolist() if t != PAD_ID]
    if END_ID in output:
        output = output[: output.index(END_ID) + 1]
    decoder_input = tf.constant([[START_ID] + output[:-1]], tf.int32)
    weights = model.attention_scores(source, decoder_input)
    translation = decode_output(tokenizer, tokens)[0].numpy().decode("utf-8", errors="replace")
    return (_pieces(source_side(tokenizer), source[0]), _pieces(target_side(tokenizer), output),
            _printable(translation), weights)


def _pieces(tokenizer, ids):
    """Token ids -> sentencepiece pieces ("▁" marks the start of a word) of one side's `tokenizer`."""
    pieces = tokenizer.id_to_string(tf.cast(tf.convert_to_tensor(ids), tf.int32)).numpy().tolist()
    return [_printable(p.decode("utf-8", errors="replace")) for p in pieces]


def _printable(text):
    """`text` with control characters escaped: byte-fallback pieces can decode to them, and fonts have no glyph."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


def _heatmap(ax, weights, x_labels, y_labels, title, xlabel, ylabel):
    # One colour scale for every panel: weights are probabilities, 0 to 1.
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(len(x_labels)), x_labels, rotation=90)
    ax.set_yticks(range(len(y_labels)), y_labels)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.tick_params(length=0)
    return image


def plot_attention(args) -> Path:
    model, tokenizer, config = load_model_dir(args.model_dir, args.model_file)
    source, output, translation, weights = translate_with_attention(
        model, tokenizer, config, args.source, args.max_output_length
    )
    layers = len(weights["encoder_self_attention"]), len(weights["decoder_cross_attention"])
    encoder = weights["encoder_self_attention"][args.layer][0].numpy()  # [heads, source, source]
    cross = weights["decoder_cross_attention"][args.layer][0].numpy()  # [heads, output, source]
    encoder_layer, decoder_layer = (range(n)[args.layer] + 1 for n in layers)
    panels = [  # (weights [heads, rows, columns], column labels, row labels, title, xlabel, ylabel)
        (encoder, source, source, f"Encoder self-attention, layer {encoder_layer} of {layers[0]}",
         "key (source piece; ▁ starts a word)", "query (source piece)"),
        (cross, source, output, f"Decoder cross-attention, layer {decoder_layer} of {layers[1]}",
         "key (source piece; ▁ starts a word)", "query (output piece it predicts)"),
    ]
    heads = encoder.shape[0]

    plt = _pyplot()
    # A third of an inch per piece keeps the tick labels apart; the figure stays under 40 inches.
    cell = 0.3
    panel_width = min(max(len(source), 6) * cell + 1.5, 40 / (2 if not args.per_head else heads))
    panel_height = min(max(len(source), len(output), 6) * cell + 1.4, 36 / (2 if args.per_head else 1))
    if args.per_head:
        fig, axes = plt.subplots(2, heads, figsize=(panel_width * heads + 1, panel_height * 2 + 0.8),
                                 layout="constrained", squeeze=False)
        for row, (w, x_labels, y_labels, title, xlabel, ylabel) in zip(axes, panels):
            for h, ax in enumerate(row):
                image = _heatmap(ax, w[h], x_labels, y_labels, f"{title}\nhead {h + 1} of {heads}", xlabel,
                                 ylabel if h == 0 else None)
    else:
        fig, axes = plt.subplots(1, 2, figsize=(panel_width * 2 + 1, panel_height + 0.8), layout="constrained")
        for ax, (w, x_labels, y_labels, title, xlabel, ylabel) in zip(axes, panels):
            image = _heatmap(ax, w.mean(axis=0), x_labels, y_labels, f"{title}\n(mean of {heads} heads)", xlabel,
                             ylabel)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    fig.suptitle(f"{args.source}\n→ {translation}")
    return _save(fig, args.out)


# --------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.plots", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("schedule", help="learning rate against optimizer step")
    s.add_argument("--out", required=True, help="PNG to write")
    s.add_argument("--model-dir", help="read d_model and warmup_steps from this run's config.json")
    s.add_argument("--d-model", type=int, default=256, help="without --model-dir (default 256, the small preset)")
    s.add_argument("--warmup-steps", type=int, default=PAPER_WARMUP_STEPS,
                   help=f"without --model-dir (default {PAPER_WARMUP_STEPS}, training.train's default)")
    s.add_argument("--steps", type=int, help="last step shown (default: 5 warm-ups, or the whole run)")
    s.set_defaults(plot=plot_schedule)

    s = sub.add_parser("loss", help="training and validation loss per epoch")
    s.add_argument("--model-dir", required=True, help="directory written by training.train (reads history.csv)")
    s.add_argument("--out", required=True, help="PNG to write")
    s.set_defaults(plot=plot_loss)

    s = sub.add_parser("attention", help="attention heatmaps for one translated sentence")
    s.add_argument("--model-dir", required=True, help="directory written by training.train")
    s.add_argument("--model-file", help="another .keras file (e.g. MODEL_DIR/averaged.keras)")
    s.add_argument("--source", required=True, help="the sentence to translate")
    s.add_argument("--out", required=True, help="PNG to write")
    s.add_argument("--layer", type=int, default=-1, help="layer to show, 0-based; negative counts from the end "
                   "(default -1, the last)")
    s.add_argument("--per-head", action="store_true", help="one panel per head instead of the mean over heads")
    s.add_argument("--max-output-length", type=int, help="output limit (default: source length + 50)")
    s.set_defaults(plot=plot_attention)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.plot(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
