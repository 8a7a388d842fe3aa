"""``spade.hf``: the Hugging Face entry points (``spade.hf.apply(model, policy)``, ...).

The code lives in ``spade.models.hf``, beside the fast backend; this module
re-exports its public names.
"""

from spade.models.hf import *  # noqa: F401,F403
from spade.models.hf import __all__  # noqa: F401
