"""Running a compiled stage in OpenVINO: stateful and paged stages, KV blocks, the stage scheduler, plugin settings, sampling."""
