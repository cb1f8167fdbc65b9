"""What every recipe model shares: frozen models, the name pattern, the error a bad recipe raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the file, the key and what was expected."""


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
