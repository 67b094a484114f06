"""Packaging: the repository keeps its layout (server/, protocol/, clients/python/), and the
installed import packages carry the project's own name (operate_sidecar.server, ...), so the
wheel can live beside another project's own ``server`` or ``protocol`` package."""

from setuptools import find_packages, setup

NS = "operate_sidecar"
packages = [NS]
package_dir = {NS: NS}
for top in ("server", "protocol"):
    package_dir[f"{NS}.{top}"] = top
    packages += [f"{NS}.{top}"] + [f"{NS}.{top}.{sub}" for sub in find_packages(top)]
package_dir[f"{NS}.clients"] = "clients"
package_dir[f"{NS}.clients.python"] = "clients/python"
packages += [f"{NS}.clients", f"{NS}.clients.python"]

setup(packages=packages, package_dir=package_dir,
      package_data={f"{NS}.protocol": ["schema.json", "README.md"]})
