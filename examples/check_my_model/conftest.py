"""One line gives the tests here the ``megatron_equivalence`` fixture."""

pytest_plugins = ["knitkit.integration.megatron.testing.pytest_plugin"]
