"""MMBench-Video's capability taxonomy and its coarse ratings (Fang et al., 2024; the VLMEvalKit scorer).

Each question is tagged with one or more fine (L3) dimensions. A coarse rating is the mean judge score (0-3)
over the questions having at least one L3 dimension in that group: Perception = CP, FP-S, FP-C, HL;
Reasoning = LR, AR, RR, CSR, TR; Overall = all. Questions the judge could not score (-1) count as 0 ("all",
the number the benchmark reports) and are left out of the "valid" variant.
"""

from __future__ import annotations

L2_DIMENSIONS = {
    "CP": ["Video Topic", "Video Emotion", "Video Scene", "Video Style"],
    "FP-S": ["OCR", "Object Recognition", "Attribute Recognition", "Event Recognition", "Human Motion", "Counting"],
    "FP-C": ["Spatial Relationship", "Human-object Interaction", "Human Interaction"],
    "HL": ["Hallucination"],
    "LR": ["Structuralized Image-Text Understanding", "Mathematical Calculation"],
    "AR": ["Physical Property", "Function Reasoning", "Identity Reasoning"],
    "RR": ["Natural Relation", "Physical Relation", "Social Relation"],
    "CSR": ["Common Sense Reasoning"],
    "TR": ["Counterfactual Reasoning", "Causal Reasoning", "Future Prediction"],
}
L1_GROUPS = {"Perception": ["CP", "FP-S", "FP-C", "HL"], "Reasoning": ["LR", "AR", "RR", "CSR", "TR"]}
L1_GROUPS["Overall"] = L1_GROUPS["Perception"] + L1_GROUPS["Reasoning"]


def _fine_names(group: str) -> set[str]:
    return {name for l2 in L1_GROUPS.get(group, [group]) for name in L2_DIMENSIONS[l2]}


def rate(items: list[tuple[list[str], int]], valid_only: bool = False) -> dict[str, float | None]:
    """items: (fine dimensions, judge score in 0..3 or -1 for a failed judgment) per question.
    Returns the three L1 ratings plus each L2 group; None where no question falls in a group."""
    out: dict[str, float | None] = {}
    for group in [*L1_GROUPS, *L2_DIMENSIONS]:
        names = _fine_names(group)
        scores = [s for dims, s in items if names.intersection(dims)]
        scores = [s for s in scores if s >= 0] if valid_only else [max(s, 0) for s in scores]
        out[group] = sum(scores) / len(scores) if scores else None
    return out


def unknown_dimensions(dims: list[str]) -> list[str]:
    known = _fine_names("Overall")
    return [d for d in dims if d not in known]
