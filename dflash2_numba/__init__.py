"""dflash2_numba: lossless speculative decoding with DFlash / DFlash2 drafts in numpy + numba."""
