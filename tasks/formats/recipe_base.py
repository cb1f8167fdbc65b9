"""What every recipe model shares: frozen models, the name pattern, the error a bad recipe raises."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

# A model block's compute precision: ``auto`` resolves per worker (tasks/models/placement.py).
ComputeDtype = Literal["auto", "fp32", "bf16", "fp16"]

NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the file, the key and what was expected."""


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
