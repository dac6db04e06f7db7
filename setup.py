"""Which folders become which installed packages; everything else is in pyproject.toml.

templates/, static/ and migrations/ stay at the top of the repository, but a wheel installs
them inside Tessera's own packages (console/templates, console/static, api/db/migrations),
so site-packages gets no generic top-level `templates`, `static` or `migrations`. The
pyproject.toml tables cannot map a folder under another package's name while also
discovering packages, hence this file. What files each package carries is pyproject.toml's
[tool.setuptools.package-data].
"""

from setuptools import find_namespace_packages, setup

# installed package -> folder in the repository
DATA_FOLDERS = {
    "console.templates": "templates",
    "console.static": "static",
    "api.db.migrations": "migrations",
}

setup(
    packages=[
        *find_namespace_packages(include=["engine*", "api*", "console*", "benchmarks*"]),
        *DATA_FOLDERS,
        "api.db.migrations.versions",
    ],
    package_dir=DATA_FOLDERS,
)
