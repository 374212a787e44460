"""Steps of Shardline's main job on the local cluster, shared by ``hack/demo.py`` and the e2e
tests: tiny model revisions on the hostPath, the chart installed with helm, CR status
transitions, and OpenAI requests to a group leader."""
