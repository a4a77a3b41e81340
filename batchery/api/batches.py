"""Routes of batches (OpenAI's API). Filled in by its owner."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
