"""Test machinery that must not live in ``src/``: helpers only tests need, such as the crash
launcher. (The conversions to torch's own ``nn`` modules are public:
``handformer.interop.torch_nn``.)"""
