"""The engine format: the contract between the builder (which writes it) and the runtime (which reads it).

    engine_dir.py    EngineDir, read_engine_dir (format version, config digest, backend, listing,
                     sha256 checksums), the config.json document (config_digest); EngineDirError
    writer.py        write_engine_dir: temp dir + atomic replace under the build lock; EngineDirBusy;
                     copy_owned (files from outside become the engine dir's own: never a hard link)
    build_config.py  BuildConfig: the recorded build options (dtypes, KV cache, block size, bounds)
    capacities.py    Capacities and the capacity rules: pick, split_prefill, power_of_two_capacities,
                     validate (the one check of a capacity list), parse_capacity_list; CapacityError
    graph_io.py      the I/O of each per-capacity graph: GraphSpec, TensorSpec, io_specs, graph_specs
    backends.py      the backend registry: names, installed TensorRT modules, lazy loading, runnable_here

It imports k3trt.config, torch and the standard library only: never the builder, runtime or model.
docs/engine_format.md describes the directory.
"""
