"""tests/data/open_clip_tiny: two tiny ViT CLIPs made by open_clip itself, their weights and their outputs.

open_clip needs torchvision, which does not install beside the project's pinned CPU torch, so this
runs in a venv of its own, once; the test suite then checks that shardsmith's open_clip reader
(tasks/models/openclip.py) computes what open_clip computed:

    python3.11 -m venv /tmp/ocvenv
    /tmp/ocvenv/bin/pip install torch==2.14.1 torchvision==0.29.1 open_clip_torch safetensors
    /tmp/ocvenv/bin/python tools/make_open_clip_fixture.py tests/data/open_clip_tiny

Weights are rounded to fp16 before the outputs are computed, so the fp16 files reproduce them.
"""

import json
import sys
from pathlib import Path

import open_clip
import torch
from safetensors.torch import save_file

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
results = {"open_clip": open_clip.__version__, "torch": torch.__version__, "models": {}}
for name, quick in (("quickgelu", True), ("gelu", False)):
    cfg = {
        "embed_dim": 16,
        "quick_gelu": quick,
        "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "patch_size": 16, "head_width": 16},
        "text_cfg": {"context_length": 12, "vocab_size": 40, "width": 32, "heads": 2, "layers": 2},
    }
    torch.manual_seed(7 if quick else 8)
    model = open_clip.model.CLIP(
        **{k: v for k, v in cfg.items()},
    )
    # Break the symmetry of the zero-initialised parts so every weight matters.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
            p.copy_(p.half().float())
    model.eval()
    d = out / name
    d.mkdir(exist_ok=True)
    save_file(
        {k: v.half().contiguous() for k, v in model.state_dict().items() if k != "attn_mask"},
        str(d / "open_clip_model.safetensors"),
    )
    (d / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": cfg, "preprocess_cfg": {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]}})
    )
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(3, 3, 32, 32, generator=g)
    ids = torch.tensor(
        [
            [0, 5, 9, 39, 0, 0, 0, 0, 0, 0, 0, 0],
            [0, 3, 4, 5, 6, 7, 39, 0, 0, 0, 0, 0],
            [0, 21, 39, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        ]
    )
    with torch.no_grad():
        img = model.encode_image(pixels, normalize=True)
        txt = model.encode_text(ids, normalize=True)
    results["models"][name] = {"pixels_seed": 1, "ids": ids.tolist(), "image": img.tolist(), "text": txt.tolist()}
(out / "expected.json").write_text(json.dumps(results, indent=1))
print("open_clip", results["open_clip"], "->", out)
