"""The shape of a review label, as a Pydantic model; review_label.schema.json is its JSON
schema, written by `python jobs/data/review_label.py`."""
import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field


class ReviewLabel(BaseModel):
    sentiment: Literal["positive", "negative", "mixed"]
    stars: int = Field(ge=1, le=5, description="the stars the text deserves")
    topics: list[Annotated[str, Field(max_length=24)]] = Field(min_length=1, max_length=3)
    summary: str = Field(max_length=60)


if __name__ == "__main__":
    path = Path(__file__).with_name("review_label.schema.json")
    path.write_text(json.dumps(ReviewLabel.model_json_schema(), indent=2) + "\n")
