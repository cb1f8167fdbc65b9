"""The demo's dual encoder: a tiny CLIP trained on the demo's own scenes and captions, and its watermark head.

The demo corpus is drawn by ``tasks.demo.scenes`` (coloured shapes over skies and grounds, with
the caption of what was drawn), so a model trained on that generator means something on it:
a caption scores above another scene's, an augmented copy of a picture lies close to it and far
from a different picture with a similar caption. Trained once with this script and committed
under ``tasks/demo/data/tiny-clip/`` (fp16 safetensors, transformers' ``CLIPModel`` layout with
its tokenizer and preprocessing), beside ``tiny-clip-heads/watermark.safetensors``:

    python -m tasks.demo.train_clip tasks/demo/data        # about 20 min on 2 cores

Scenes come from seeds other than the demo corpus's, so nothing in the demo was seen in
training. Objective: CLIP's symmetric InfoNCE between images and captions, plus SimCLR's
between two augmented views of each image (crops, flips, re-encodes at other sizes and
qualities, a small corner overlay), as SLIP combines them: the image embedding then knows
both what a picture shows and which picture it is.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from tasks.demo.copies import augment, watermark
from tasks.demo.scenes import COLOURS, SHAPES, add_grain, draw_scene, draw_shape, write_caption

SIZE = 64  # the vision tower's input: whole pictures squashed to SIZE x SIZE (no crop)
PATCH = 8
MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)
CONTEXT = 40
SEED = 20261203  # far from the demo corpus's seeds (0 and small integers)


# ------------------------------------------------------------------------------ data


def render(rng: np.random.Generator) -> tuple[Image.Image, str]:
    """One training scene at a small size, composited as validation stores it, and its caption."""
    return _scenes(rng, sibling=False)[0]


def render_pair(rng: np.random.Generator) -> tuple[Image.Image, str, Image.Image, str]:
    """A scene and its sibling: the same picture with one more small shape, and their captions:
    a different picture that looks almost the same, the hard negative semantic dedup must keep apart."""
    (a, ca), (b, cb) = _scenes(rng, sibling=True)
    return a, ca, b, cb


def _scenes(rng: np.random.Generator, sibling: bool) -> list[tuple[Image.Image, str]]:
    kind = ["jpeg", "jpeg", "jpeg", "jpeg", "jpeg-gray", "png-rgba", "png"][int(rng.integers(7))]
    short = int(rng.integers(72, 160))
    aspect = float(rng.uniform(0.5, 2.5))
    w, h = (int(short * aspect), short) if aspect >= 1 else (short, int(short / aspect))
    img, drawn = draw_scene(rng, w, h, transparent=(kind == "png-rgba"))
    todo: list[tuple[Image.Image, dict[str, Any]]] = [(img, drawn)]
    if sibling:
        extra = img.copy()
        colour, shape = str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES))
        r = min(w, h) * rng.uniform(0.05, 0.1)
        cx, cy = rng.uniform(r, w - r), rng.uniform(r, max(r + 1, h * 0.4))
        fill = COLOURS[colour] + ((255,) if kind == "png-rgba" else ())
        draw_shape(ImageDraw.Draw(extra), shape, fill, cx, cy, r, rng)
        todo.append((extra, {**drawn, "groups": [*drawn["groups"], (1, colour, shape)]}))
    out = []
    for picture, what in todo:
        if kind == "png-rgba":  # alpha composited on white, as validation does
            white = Image.new("RGB", picture.size, (255, 255, 255))
            white.paste(picture, (0, 0), picture)
            picture = white
        if kind == "jpeg-gray":
            picture = picture.convert("L").convert("RGB")
        if kind.startswith("jpeg"):
            picture = add_grain(np.random.default_rng(int(rng.integers(1 << 31))), picture.convert("RGB"), 4)
        out.append(
            (picture.convert("RGB"), write_caption(np.random.default_rng(int(rng.integers(1 << 31))), what, kind))
        )
    return out


def pixels(img: Image.Image) -> np.ndarray:
    """(3, SIZE, SIZE) float32, as the pipeline feeds the model: squashed, antialiased, normalised."""
    a = np.asarray(img.convert("RGB").resize((SIZE, SIZE), Image.Resampling.BILINEAR), np.float32) / 255.0
    return ((a - np.array(MEAN, np.float32)) / np.array(STD, np.float32)).transpose(2, 0, 1)


def vocabulary(rng: np.random.Generator, n: int = 20000) -> list[str]:
    """Every word the caption writer emits (lower case, punctuation apart), from ``n`` captions."""
    import re

    words: set[str] = set()
    for _ in range(n):
        _, cap = render_caption_only(rng)
        words.update(re.findall(r"\w+|[^\w\s]", cap.lower()))
    return sorted(words)


def render_caption_only(rng: np.random.Generator) -> tuple[None, str]:
    kind = ["jpeg", "jpeg-gray", "png-rgba", "png"][int(rng.integers(4))]
    _, drawn = draw_scene(rng, 16, 16, transparent=(kind == "png-rgba"))
    return None, write_caption(rng, drawn, kind)


# ------------------------------------------------------------------------------ model


def make_tokenizer(path: Path, words: list[str]) -> Any:
    """The word-level tokenizer of ``words`` (tasks.demo.models.make_tokenizer), saved and loaded."""
    from transformers import AutoTokenizer

    from tasks.demo.models import make_tokenizer as save_tokenizer

    return AutoTokenizer.from_pretrained(save_tokenizer(path, CONTEXT, words))


def make_model(tok: Any) -> Any:
    from transformers import CLIPConfig, CLIPModel

    width = 96
    cfg = CLIPConfig(
        projection_dim=64,
        text_config=dict(
            hidden_size=width,
            intermediate_size=width * 3,
            num_hidden_layers=3,
            num_attention_heads=4,
            vocab_size=len(tok),
            max_position_embeddings=CONTEXT,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
        ),
        vision_config=dict(
            hidden_size=width,
            intermediate_size=width * 3,
            num_hidden_layers=4,
            num_attention_heads=4,
            image_size=SIZE,
            patch_size=PATCH,
        ),
    )
    return CLIPModel(cfg)


def _features(model: Any, out: Any) -> Any:
    import torch

    t = getattr(out, "pooler_output", out)
    return torch.nn.functional.normalize(t, dim=-1)


def train(
    out_dir: Path,
    steps: int,
    batch: int,
    pool_size: int,
    log: Any = print,
    resume: bool = False,
    watermarked: int = 0,
    siblings: int = 0,
    peak_lr: float = 2e-3,
) -> Path:
    """Train the tiny CLIP and save it (fp16) with its tokenizer and preprocessing under ``out_dir/tiny-clip``.

    ``resume``: go on from the model saved there. ``watermarked``: per batch, that many
    watermarked versions of pictures of the batch as pictures of their own, so that the
    embedding keeps a watermark visible (augmented views never carry one). ``siblings``: per
    batch, that many pairs of a picture and the same picture with one more small shape, as
    pictures of their own: the hard negatives that teach it which picture it is.
    """
    import torch
    from transformers import AutoTokenizer, CLIPModel

    torch.manual_seed(SEED + int(resume))
    torch.set_num_threads(2)
    rng = np.random.default_rng(SEED + int(resume))
    path = out_dir / "tiny-clip"
    path.mkdir(parents=True, exist_ok=True)
    if resume:
        tok = AutoTokenizer.from_pretrained(path)
        model = CLIPModel.from_pretrained(path, torch_dtype=torch.float32)
    else:
        tok = make_tokenizer(path, vocabulary(np.random.default_rng(SEED + 1)))
        model = make_model(tok)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.05)
    pool = [render(rng) for _ in range(pool_size)]
    pairs = [render_pair(rng) for _ in range(pool_size // 4 if siblings else 0)]
    start = time.perf_counter()
    for step in range(steps):
        if step and step % 400 == 0:  # fresh scenes now and then: the generator is the dataset
            for i in rng.choice(pool_size, size=pool_size // 3, replace=False):
                pool[int(i)] = render(rng)
        lr = peak_lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = rng.choice(pool_size, size=batch - watermarked - 2 * siblings, replace=False)
        imgs = [pool[int(i)][0] for i in idx]
        caps = [pool[int(i)][1] for i in idx]
        imgs += [watermark(im, rng) for im in imgs[:watermarked]]
        caps += caps[:watermarked]
        for i in rng.choice(len(pairs), size=siblings, replace=False) if siblings else []:
            a, ca, b, cb = pairs[int(i)]
            imgs += [a, b]
            caps += [ca, cb]
        v1 = torch.from_numpy(np.stack([pixels(augment(im, rng)) for im in imgs]))
        v2 = torch.from_numpy(np.stack([pixels(augment(im, rng)) for im in imgs]))
        t = tok(caps, padding=True, truncation=True, max_length=CONTEXT, return_tensors="pt")
        e = _features(model, model.get_image_features(pixel_values=torch.cat([v1, v2])))
        e1, e2 = e[:batch], e[batch:]
        txt = _features(model, model.get_text_features(input_ids=t["input_ids"], attention_mask=t["attention_mask"]))
        scale = model.logit_scale.exp().clamp(max=100)
        labels = torch.arange(batch)
        ce = torch.nn.functional.cross_entropy
        clip = sum((ce(scale * im @ txt.T, labels) + ce(scale * txt @ im.T, labels)) / 2 for im in (e1, e2)) / 2
        sim = (e1 @ e2.T) / 0.1
        simclr = (ce(sim, labels) + ce(sim.T, labels)) / 2
        loss = clip + simclr
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(
                f"step {step} loss {loss.item():.3f} (clip {clip.item():.3f}, simclr {simclr.item():.3f}) {time.perf_counter() - start:.0f} s"
            )
    model = model.half()
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "do_resize": True,
                "size": {"height": SIZE, "width": SIZE},
                "do_center_crop": False,
                "image_mean": list(MEAN),
                "image_std": list(STD),
            },
            indent=1,
        )
    )
    return path


def train_watermark_head(model_dir: Path, out: Path, n: int = 1500) -> Path:
    """A linear head, LAION-aesthetics' format (``weight`` (1, D), ``bias`` (1,)): logistic
    regression of clean against watermarked scenes on the model's normalised image embeddings.
    Its score: ``sigmoid(weight . e + bias)`` (``output: sigmoid``)."""
    import torch
    from safetensors.torch import save_file
    from transformers import CLIPModel

    rng = np.random.default_rng(SEED + 2)
    model = CLIPModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    clean = [render(rng)[0] for _ in range(n)]
    marked = [watermark(render(rng)[0], rng) for _ in range(n)]
    with torch.no_grad():
        x = torch.cat(
            [
                _features(
                    model, model.get_image_features(pixel_values=torch.from_numpy(np.stack([pixels(i) for i in part])))
                )
                for part in (clean, marked)
            ]
        )
    y = torch.cat([torch.zeros(n), torch.ones(n)])
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=200)

    def closure() -> Any:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y) + 1e-4 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "watermark.safetensors"
    save_file({"weight": w.detach()[None, :].contiguous(), "bias": b.detach().contiguous()}, str(path))
    return path


def evaluate(model_dir: Path, head: Path | None = None, n: int = 400, seed: int = 7) -> dict[str, float]:
    """Quick checks on fresh scenes: AUC of own against another scene's caption, AUC of copies
    against distinct scenes by image cosine, and (with ``head``) AUC of watermarked against clean."""
    import torch
    from transformers import AutoTokenizer, CLIPModel

    rng = np.random.default_rng(seed)
    model = CLIPModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    scenes = [render(rng) for _ in range(n)]

    def embed(imgs: list[Image.Image]) -> np.ndarray:
        with torch.no_grad():
            px = torch.from_numpy(np.stack([pixels(i) for i in imgs]))
            return _features(model, model.get_image_features(pixel_values=px)).numpy()

    img = embed([s[0] for s in scenes])
    copies = embed([augment(s[0], rng) for s in scenes])
    sibs = [render_pair(rng) for _ in range(n // 2)]
    sa, sb = embed([p[0] for p in sibs]), embed([p[2] for p in sibs])
    with torch.no_grad():
        t = tok([s[1] for s in scenes], padding=True, return_tensors="pt")
        txt = _features(
            model, model.get_text_features(input_ids=t["input_ids"], attention_mask=t["attention_mask"])
        ).numpy()
    other = np.roll(np.arange(n), 1)
    own, mismatched = (img * txt).sum(1), (img * txt[other]).sum(1)
    same, distinct = (img * copies).sum(1), (img * img[other]).sum(1)
    out = {"alignment_auc": _auc(own, mismatched), "copy_auc": _auc(same, distinct)}
    out.update(own_mean=float(own.mean()), mismatched_mean=float(mismatched.mean()))
    out.update(copy_p05=float(np.percentile(same, 5)), distinct_p99=float(np.percentile(distinct, 99)))
    sib = (sa * sb).sum(1)
    out.update(
        sibling_p50=float(np.median(sib)),
        sibling_p95=float(np.percentile(sib, 95)),
        copy_vs_sibling_auc=_auc(same, sib),
    )
    if head is not None:
        from safetensors.numpy import load_file

        h = load_file(str(head))
        marked = embed([watermark(s[0], rng) for s in scenes[: n // 2]])
        score = lambda e: 1 / (1 + np.exp(-(e @ h["weight"][0] + h["bias"][0])))  # noqa: E731
        out["watermark_auc"] = _auc(score(marked), score(img[n // 2 :]))
    return out


def _auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """ROC AUC: the chance a positive scores above a negative (ties count half)."""
    pos, neg = np.asarray(pos)[:, None], np.asarray(neg)[None, :]
    return float((pos > neg).mean() + 0.5 * (pos == neg).mean())


def main(argv: list[str]) -> int:
    out = Path(argv[1] if len(argv) > 1 else "tasks/demo/data")
    steps = int(argv[2]) if len(argv) > 2 else 1500
    start = time.perf_counter()
    train(out, steps=steps, batch=96, pool_size=6000)
    # Then with watermarked pictures and near-identical siblings among the others, at a lower rate.
    model = train(
        out, steps=steps // 2, batch=96, pool_size=3000, resume=True, watermarked=12, siblings=12, peak_lr=7e-4
    )
    head = train_watermark_head(model, out / "tiny-clip-heads")
    print(f"{model} and {head} in {time.perf_counter() - start:.0f} s")
    print(json.dumps(evaluate(model, head), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
