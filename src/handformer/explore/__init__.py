"""See inside a run: attention weights, masks and the KV cache, in the browser.

``handformer explore --run DIR`` serves a local page (standard library only, no CDN). From
Python, the capture it is built on is ``handformer.capture.capture_attention``: every
layer's weights and mask for one forward pass, without leaving anything on the model.
"""
