"""Fine-tune Gemma 4 on an output folder's stored tokens: no decode, no tower (docs/training.md).

The public name of output/training.py: `from gemma4enc.training import Collator, Conversations`.
"""

from .output.training import (  # noqa: F401 - the public face
    IGNORE,
    Check,
    Collator,
    Conversations,
    TrainingDataError,
    check,
    freeze_vision,
    media_parts,
    merge,
    read_conversations,
)
