"""COCO caption metrics through pycocoevalcap's scorer classes, each called on its own.

COCOEvalCap.evaluate() is never used: it always runs SPICE, whose first use downloads Stanford CoreNLP. Java runs
the PTB tokenizer and METEOR; without Java, a pure-Python tokenizer stands in for BLEU/ROUGE-L/CIDEr (numbers
then differ slightly from the official ones) and METEOR is reported as unavailable, with a note saying why.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
from pathlib import Path

ORDER = ["SPICE", "BLEU_1", "BLEU_2", "BLEU_3", "BLEU_4", "METEOR", "ROUGE_L", "CIDEr"]
# The tokens the official PTB tokenizer wrapper drops after tokenizing.
_PUNCT = {"''", "'", "``", "`", "-lrb-", "-rrb-", "-lcb-", "-rcb-", ".", "?", "!", ",", ":", "-", "--", "...", ";"}


def _import_scorers():
    try:
        from pycocoevalcap.bleu.bleu import Bleu
        from pycocoevalcap.cider.cider import Cider
        from pycocoevalcap.rouge.rouge import Rouge
    except ImportError:
        raise ImportError("COCO caption metrics need pycocoevalcap: pip install 'mmkv[eval]'") from None
    return Bleu, Cider, Rouge


def simple_tokenize(text: str) -> str:
    """Close to PTBTokenizer -lowerCase for plain English captions: clitics split off, punctuation dropped."""
    text = re.sub(r"(\w)('s|'re|'ve|'ll|'d|'m|n't)\b", r"\1 \2", text.lower().replace("\n", " "))
    tokens = re.findall(r"[\w']+(?:-[\w']+)*|[^\w\s]", text)  # PTB keeps "dog-like" whole
    return " ".join(t for t in tokens if t not in _PUNCT and not re.fullmatch(r"[^\w]+", t))


def tokenize(captions: dict[str, list[str]], notes: list[str]) -> dict[str, list[str]]:
    if shutil.which("java"):
        try:
            from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

            wrapped = {k: [{"caption": c} for c in v] for k, v in captions.items()}
            out = PTBTokenizer().tokenize(wrapped)
            if all(len(out.get(k, [])) == len(v) for k, v in captions.items()):
                return out
            notes.append("PTB tokenizer returned fewer lines than captions; used the pure-Python tokenizer")
        except Exception as e:  # a read-only site-packages or a broken JVM: fall back, say so
            notes.append(f"PTB tokenizer failed ({type(e).__name__}: {e}); used the pure-Python tokenizer")
    else:
        notes.append("Java not found: pure-Python tokenizer used instead of the PTB tokenizer (BLEU/ROUGE-L/CIDEr "
                     "may differ slightly from official numbers); METEOR unavailable (apt-get install "
                     "default-jre-headless)")
    return {k: [simple_tokenize(c) for c in v] for k, v in captions.items()}


_METEOR = []  # one METEOR JVM per process: its start (loading the paraphrase table) takes seconds


def _meteor(gts, res, notes) -> float | None:
    if not shutil.which("java"):
        return None
    try:
        from pycocoevalcap.meteor.meteor import Meteor

        if not _METEOR:
            _METEOR.append(Meteor())
        return float(_METEOR[0].compute_score(gts, res)[0])
    except Exception as e:
        _METEOR.clear()
        notes.append(f"METEOR failed ({type(e).__name__}: {e})")
        return None


def _spice(gts, res, notes) -> float | None:
    try:
        from pycocoevalcap.spice import spice as spice_mod
    except ImportError:
        return None
    jar = Path(spice_mod.__file__).parent / "lib" / "stanford-corenlp-3.6.0.jar"
    if not shutil.which("java") or not jar.exists():
        notes.append(f"SPICE unavailable: needs Java and {jar} (eval/tasks/coco_caption/README.md says how to get it); "
                     "it is never downloaded at run time")
        return None
    try:
        scorer = spice_mod.Spice.__new__(spice_mod.Spice)  # skip __init__, which would download CoreNLP
        return float(scorer.compute_score(gts, res)[0])
    except Exception as e:
        notes.append(f"SPICE failed ({type(e).__name__}: {e})")
        return None


def caption_scores(refs: dict[str, list[str]], preds: dict[str, str], spice: bool = False) -> tuple[dict, list]:
    """refs: id -> reference captions; preds: id -> one generated caption. Returns ({metric: value}, notes)."""
    Bleu, Cider, Rouge = _import_scorers()
    notes: list[str] = []
    ids = sorted(refs)
    # One tokenizer call for both sides, tagged so ids cannot collide.
    toks = tokenize({**{f"g{k}": refs[k] for k in ids}, **{f"r{k}": [preds[k]] for k in ids}}, notes)
    gts = {k: toks[f"g{k}"] for k in ids}
    # METEOR's Java side chokes on an empty hypothesis line; one blank-equivalent token scores the same (zero).
    res = {k: [toks[f"r{k}"][0] or "."] for k in ids}
    scores: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):  # pycocoevalcap prints its internals
        bleu = Bleu(4).compute_score(gts, res)[0]
        scores.update({f"BLEU_{n + 1}": float(b) for n, b in enumerate(bleu)})
        scores["ROUGE_L"] = float(Rouge().compute_score(gts, res)[0])
        scores["CIDEr"] = float(Cider().compute_score(gts, res)[0])
    scores["METEOR"] = _meteor(gts, res, notes)
    if spice:
        scores["SPICE"] = _spice(gts, res, notes)
    return {m: scores[m] for m in ORDER if m in scores}, notes
