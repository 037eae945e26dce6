"""Layer 1, the inputs: a call's (inputs, outputs, keywords) become one normalised view per microbatch
(microbatches -> sequences -> the CP cut -> packed rows -> the view).
"""
