"""Weight quantizers producing the format's encodings, bit-exact with what the runtime decodes.

* :mod:`.rtn`: round to nearest (the codec's scales, or a Hessian-weighted scale search);
* :mod:`.gptq`: GPTQ error compensation against the calibration Hessian;
* :mod:`.awq`: activation-aware per-input-channel scales, folded into the previous op;
* :mod:`.smoothquant`: activation outliers migrated into the weights (int8 activations).

Every quantizer returns ``(EncodedTensor, decoded float32 [R, C])``; the decoded matrix is
exactly what :mod:`edgepack.format.codecs` makes of the stored parts.
"""

from .gptq import gptq_quantize, output_error
from .rtn import rtn_quantize

__all__ = ["gptq_quantize", "output_error", "rtn_quantize"]
