"""The names of the off-policy correction modes (docs/algorithm.md, "Off-policy correction"): the
config validates them, asyncgrpo/losses/off_policy.py implements them."""

# The default: two-sided token masking, as IcePop masks, without a weight of its own (the clipped
# loss already carries the ratio, score centering needs none).
ICEPOP = "icepop"
TOKEN_TRUNCATE = "token_truncate"
TOKEN_MASK = "token_mask"
SEQUENCE_TRUNCATE = "sequence_truncate"
SEQUENCE_MASK = "sequence_mask"
SEQUENCE_GEOMETRIC_MASK = "sequence_geometric_mask"
MODES = (ICEPOP, TOKEN_TRUNCATE, TOKEN_MASK, SEQUENCE_TRUNCATE, SEQUENCE_MASK, SEQUENCE_GEOMETRIC_MASK)
# Modes whose ratio (clipped or masked) becomes the entry's importance weight; the others only mask.
REWEIGHTING_MODES = (TOKEN_TRUNCATE, TOKEN_MASK, SEQUENCE_TRUNCATE, SEQUENCE_MASK)
SEQUENCE_MODES = (SEQUENCE_TRUNCATE, SEQUENCE_MASK, SEQUENCE_GEOMETRIC_MASK)
TRUNCATE_MODES = (TOKEN_TRUNCATE, SEQUENCE_TRUNCATE)
