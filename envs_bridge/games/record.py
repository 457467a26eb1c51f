"""The one JSON schema of game verifier records (what the state script returns for every game).

Source: issue #5 item 4 ("records in one JSON schema: scalar reward, termination flag, metadata:
game name, version, checksum"). `GameRecord.model_json_schema()` is the JSON Schema.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_ID = "tars_jax.game_record/1"


class GameRecord(BaseModel):
  """One verifier reading of a game page.

  reward = score / reference_score (float; 1.0 = the reference player's mean score), given to the
  agent when the episode ends; normalized_score = 100 x reward. raw_reward = score.
  """

  model_config = ConfigDict(extra="forbid")

  schema_: str = Field(SCHEMA_ID, alias="schema", pattern="^tars_jax\\.game_record/1$")
  game: str = Field(..., description="game name, e.g. '2048' (task 'games/2048')")
  version: str = Field(..., description="version of the game code (the page's GAME.def.version)")
  checksum: str = Field(..., pattern="^[0-9a-f]{64}$", description="sha256 over the game's files")
  seed: int = Field(..., ge=0)
  score: float
  reward: float
  raw_reward: float
  normalized_score: float
  reference_score: float = Field(..., gt=0)
  done: bool
  won: bool
  reason: str | None
  level: int = Field(..., ge=0)
  lives: int = Field(..., ge=0)
  elapsed_ms: int = Field(..., ge=0, description="virtual ms since the episode started")
  moves: int = Field(..., ge=0, description="inputs the game accepted as moves")


def validate(record: dict) -> GameRecord:
  """Parses a state-script result; raises pydantic.ValidationError if it breaks the schema."""
  return GameRecord.model_validate(record)
