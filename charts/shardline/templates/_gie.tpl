{{/* The EPP's EndpointPickerConfig: upstream's default profile (queue-scorer 2,
kv-cache-utilization-scorer 2, prefix-cache-scorer 3; epplib's _config.yaml) scraping the
runtime's model-server-protocol gauges (runtime/shardline_runtime/entrypoints/metrics.py) as
engine "shardline". The prefix scorer's parameters go to its data producer
(approx-prefix-cache-producer): autoTune (upstream's default) takes the block size and the
index's capacity from cache_config_info (block_size 1, num_gpu_blocks = KV tokens), so
maxPrefixTokensToMatch sets the hashed window in tokens (inferencePool.epp.prefixMatchTokens). */}}
{{- define "shardline.eppConfig" -}}
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
  parameters:
    autoTune: true
    maxPrefixTokensToMatch: {{ .Values.inferencePool.epp.prefixMatchTokens }}
- type: metrics-data-source
  parameters:
    scheme: "http"
    path: "/metrics"
- type: core-metrics-extractor
  parameters:
    defaultEngine: shardline
    engineConfigs:
    - name: shardline
      queuedRequestsSpec: "shardline:num_requests_waiting"
      runningRequestsSpec: "shardline:num_requests_running"
      kvUsageSpec: "shardline:kv_cache_usage_perc"
      loraSpec: "shardline:lora_requests_info"
      cacheInfoSpec: "shardline:cache_config_info"
      cacheBlockSizeLabelName: "block_size"
      cacheNumBlocksLabelName: "num_gpu_blocks"
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
{{- end -}}

{{/* The EPP's flags for the pool of one InferenceDeployment (dict: name, namespace, values =
.Values.inferencePool); --config-file is added by the caller. */}}
{{- define "shardline.eppArgs" -}}
- --pool-name={{ .name }}
- --pool-namespace={{ .namespace }}
- --pool-group=inference.networking.k8s.io
- --grpc-port={{ .values.epp.extProcPort }}
- --zap-encoder=json
- --tracing=false
- --metrics-endpoint-auth=false
{{- end -}}
