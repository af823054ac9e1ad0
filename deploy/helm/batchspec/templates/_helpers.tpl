{{/* Names: <release>-<component>, trimmed to the 63 characters a DNS label allows. */}}
{{- define "batchspec.name" -}}
{{- printf "%s-%s" .root.Release.Name .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "batchspec.selectorLabels" -}}
app.kubernetes.io/name: batchspec
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "batchspec.labels" -}}
{{ include "batchspec.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "batchspec.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (printf "%s-coordinator" .Release.Name | trunc 63 | trimSuffix "-") .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The TLS flags every component takes: it serves with the certificate and shows it to
     its peers (mutual TLS), trusting the CA. */}}
{{- define "batchspec.tlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert
- /tls/tls.crt
- --tls-key
- /tls/tls.key
- --tls-ca
- /tls/ca.pem
{{- end }}
{{- end -}}

{{/* Readiness and start-up: the gRPC health of the component's service, natively, or with
     `batchspec health` over mutual TLS (Kubernetes' gRPC probes speak no TLS). Liveness: the
     port accepts connections, which stays true while a terminating service drains (its
     health then says NOT_SERVING on purpose). */}}
{{- define "batchspec.probes" -}}
{{- $root := .root -}}
{{- if $root.Values.tls.enabled }}
readinessProbe:
  exec:
    command: ["batchspec", "health", "127.0.0.1:{{ .port }}", "{{ .service }}", "--tls-ca", "/tls/ca.pem", "--client-cert", "/tls/tls.crt", "--client-key", "/tls/tls.key"]
  periodSeconds: 5
  timeoutSeconds: 4
startupProbe:
  exec:
    command: ["batchspec", "health", "127.0.0.1:{{ .port }}", "{{ .service }}", "--tls-ca", "/tls/ca.pem", "--client-cert", "/tls/tls.crt", "--client-key", "/tls/tls.key"]
  periodSeconds: 5
  timeoutSeconds: 4
  failureThreshold: 120
{{- else }}
readinessProbe:
  grpc:
    port: {{ .port }}
    service: {{ .service }}
  periodSeconds: 5
startupProbe:
  grpc:
    port: {{ .port }}
    service: {{ .service }}
  periodSeconds: 5
  failureThreshold: 120
{{- end }}
livenessProbe:
  tcpSocket:
    port: {{ .port }}
  periodSeconds: 10
  failureThreshold: 6
{{- end -}}

{{- define "batchspec.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    items:
      - {key: ca.pem, path: ca.pem}
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
{{- end }}
{{- end -}}

{{- define "batchspec.tlsMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /tls
  readOnly: true
{{- end }}
{{- end -}}
