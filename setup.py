"""Package discovery: every package under knitkit/ and integration/ (as knitkit.integration.*)."""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["knitkit", "knitkit.*"]),
        "knitkit.integration",
        *(f"knitkit.integration.{name}" for name in find_packages("integration")),
    ]
)
