"""Held-out benchmark texts that every machine has without downloads: Python standard-library files
that the default model never trained on (every 50th file, ``longflash.training.data``), and a few
public-domain prose passages written here."""

from __future__ import annotations

PROSE = [
    "When in the course of human events it becomes necessary for one people to dissolve the political bands "
    "which have connected them with another, and to assume among the powers of the earth the separate and equal "
    "station to which the laws of nature entitle them, a decent respect to the opinions of mankind requires "
    "that they should declare the causes which impel them to the separation.",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it "
    "was the season of Darkness, it was the spring of hope, it was the winter of despair.",
    "FIRST LORD. My lord, the king is coming to the castle, and bids you meet him at the gate with all your "
    "train. SECOND LORD. I will go tell my master so, and bid him make him ready; for the night is cold, and "
    "the way is long, and he is weary of the road.",
    "Of all the creatures that the earth doth bear, none is so fair as she whom I do love; her eyes are like "
    "the stars of heaven, and her voice is sweeter than the nightingale that sings in the green wood at dawn.",
]


def held_out_texts(kind: str) -> list[str]:
    """``code``: held-out stdlib sources; ``prose``: the passages above."""
    if kind == "code":
        from longflash.training.data import load_code
        return load_code(max_bytes_per_file=20_000)[1]
    return list(PROSE)
