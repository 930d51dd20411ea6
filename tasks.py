"""rig's command line: `inv --list`. Thin by design — every task is one call into rig."""

from invoke import Collection

from rig.cli import bench, dev, env, kernels, model, patch, plan, quality, repro, serve

ns = Collection()
ns.add_collection(env.ns)
ns.add_collection(patch.ns)
ns.add_collection(bench.ns)
ns.add_collection(model.ns)
ns.add_collection(kernels.ns)
ns.add_task(serve.serve)
ns.add_task(serve.service)
ns.add_task(plan.plan)
ns.add_task(quality.quality)
ns.add_task(repro.repro)
ns.add_task(dev.test)
ns.add_task(dev.verify)
ns.add_task(dev.docs)
ns.add_task(dev.golden)
ns.add_task(dev.figures)
