"""Verification: who signed what, whether an update looks honest, and how updates are combined.

A received update passes, in order: its signed commitment (`commitment.py`, keys in
`identity.py`), the screen of its decoded delta against the round's other deltas (`screen.py`),
replay of sampled segments (elsewhere), and finally robust aggregation of the accepted deltas
(`aggregate.py`). Every rejection carries one of the reason codes below, so a ledger entry, a log
line and a test all use the same word for the same thing.
"""

# Reason codes: the one place they are spelled. A verdict is ACCEPT or exactly one of the others.
ACCEPT = "accept"
MALFORMED = "malformed"  # bytes/JSON/packet fail the format, size or type checks
BAD_SIGNATURE = "bad_signature"  # the signature does not verify under the admitted key
UNKNOWN_WORKER = "unknown_worker"  # the worker id is not admitted to this run
KEY_MISMATCH = "key_mismatch"  # the embedded public key is not the one admitted for that worker
EQUIVOCATION = "equivocation"  # the worker signed two different commitments for one round
STALE_BASE = "stale_base"  # started from params other than this round's G_r
DUPLICATE = "duplicate"  # same packet bytes as another packet this round or last round
NEAR_DUPLICATE = "near_duplicate"  # a copy (rescaled / plus small noise) of another delta
NORM_OUTLIER = "norm_outlier"  # zero, or too large / too small next to the median norm
COSINE_OUTLIER = "cosine_outlier"  # points away from the robust centre of the round
NO_LOSS_GAIN = "no_loss_gain"  # does not lower the loss on the batches it trained on
WRONG_DATA = "wrong_data"  # helps random batches as much as its own: not trained on its data
REPLAY_MISMATCH = "replay_mismatch"  # a replay misses the committed trace (exact) or delta (distance)
WITHHELD = "withheld"  # committed but the packet (or a requested segment) never arrived
LATE = "late"  # arrived after the round's deadline
ABSENT = "absent"  # no packet this round: dead, partitioned away, or not yet (re)joined
FALSE_REPORT = "false_report"  # as auditor, reported a failed replay that every other replay passes
BANNED = "banned"  # an earlier round proved it cheated (see OFFENCES): its packets are refused
OTHER_STAGE = "other_stage"  # pipelined worker: another stage rejected its slice, so no slice is taken
UNREVEALED = "unrevealed"  # the salt it revealed is not the one its commitment hashed (commit-reveal)

# Verdicts that prove, from the worker's own signed bytes or a replay every member redid, that it
# cheated; with `[verify] ban = true` the worker is refused from the next round on. A bad
# signature is not among them: anyone can send bytes that fail under someone else's key.
# A wrong salt is one too: an honest worker's reveal is its own deterministic salt, sent whole or
# (the exchange failing) not at all, so a salt that misses its signed hash was chosen.
OFFENCES: tuple[str, ...] = (REPLAY_MISMATCH, EQUIVOCATION, FALSE_REPORT, UNREVEALED)

REASONS: tuple[str, ...] = (
    ACCEPT,
    MALFORMED,
    BAD_SIGNATURE,
    UNKNOWN_WORKER,
    KEY_MISMATCH,
    EQUIVOCATION,
    STALE_BASE,
    DUPLICATE,
    NEAR_DUPLICATE,
    NORM_OUTLIER,
    COSINE_OUTLIER,
    NO_LOSS_GAIN,
    WRONG_DATA,
    REPLAY_MISMATCH,
    WITHHELD,
    LATE,
    ABSENT,
    FALSE_REPORT,
    BANNED,
    OTHER_STAGE,
    UNREVEALED,
)

# The submodules import the codes above, so they come after them.
from .aggregate import aggregate  # noqa: E402
from .commitment import (  # noqa: E402
    Commitment,
    CommitmentError,
    EquivocationDetector,
    SignedCommitment,
    check_commitment,
    check_packet,
    check_signature,
    commitment_bytes,
    parse_signed_commitment,
    sign_commitment,
)
from .identity import (  # noqa: E402
    IdentityError,
    derive_worker_key,
    generate_key,
    load_private_key,
    load_public_key,
    public_key_hex,
    save_private_key,
    sign,
    verify_signature,
)
from .screen import LossGain, ScreenConfig, Verdict, screen_round  # noqa: E402

__all__ = [
    "REASONS",
    "Commitment",
    "CommitmentError",
    "EquivocationDetector",
    "IdentityError",
    "LossGain",
    "ScreenConfig",
    "SignedCommitment",
    "Verdict",
    "aggregate",
    "check_commitment",
    "check_packet",
    "check_signature",
    "commitment_bytes",
    "derive_worker_key",
    "generate_key",
    "load_private_key",
    "load_public_key",
    "parse_signed_commitment",
    "public_key_hex",
    "save_private_key",
    "screen_round",
    "sign",
    "sign_commitment",
    "verify_signature",
]
