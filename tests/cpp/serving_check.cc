// serving_check: loads an exported translator the way TF Serving does and runs requests through it.
//
// tensorflow_model_server is a C++ binary: it links TensorFlow's and tensorflow-text's kernels, loads a
// SavedModel with tensorflow::LoadSavedModel (the TF1 session loader, tag "serve"), replays the
// export's assets.extra/tf_serving_warmup_requests, then calls Session::Run from many request threads
// on one session. This program does the same with the TensorFlow C++ library of the installed wheel,
// so tests/test_cpp_loader.py can check an export without the model server (it builds and runs it).
//
//   serving_check EXPORT_DIR TF_TEXT_OPS_DIR [--requests FILE] [--warmup] [--threads N]
//
// --requests FILE  runs each request of FILE in turn. FILE holds, per request, a line
//                  "LABEL SIGNATURE N" and then N lines, the texts in hex (hex keeps every byte:
//                  empty strings, NUL, invalid UTF-8, and N = 0 is a batch of 0), fed to the
//                  signature's "text" input. Then, if the signature has more inputs, a line
//                  "inputs K" and K inputs, each a line "NAME N" and N lines, its values: fed to the
//                  signature's input NAME as a [N] tensor of the dtype the signature declares for it
//                  (string: hex, like the texts; int32, int64: decimal; float: anything strtod reads,
//                  e.g. Python's float.hex(), exact). A request without the "inputs" line feeds text only.
// --warmup         first replays the export's warm-up records (labels "warmup:I").
// --threads N      then runs FILE's requests again from N threads at once (thread T sends requests
//                  T, T + N, ...), prints every answer again (labels "concurrent:LABEL") and compares it
//                  with the sequential one.
//
// Output on stdout, one JSON object per line:
//   {"label": L, "signature": S, "score": [...], "score_shape": [...], "translation": [...], ...}
//     each output of the signature, any shape, flattened (row-major) beside its shape: strings in hex,
//     floats as their 32 bits in hex (exact), ints and bools as they are;
//   {"label": L, "signature": S, "error": "..."} when Session::Run fails, or an input is not the
//     signature's or its values do not parse as its dtype (the request fails, not the program);
//   {"concurrent": {"threads": N, "requests": R, "mismatches": [L...], "errors": [L...], "seconds": T,
//                   "batches": {"SIZE": COUNT, ...}}}: "mismatches" differ from the sequential answer in
//     any byte (a float's last bit included); "batches" counts the batches that BatchFunction ops ran during
//     the concurrent runs, by size (TensorFlow's own metric, /tensorflow/serving/batching/
//     processed_batch_size_v2, what TF Serving exports to Prometheus): an export that merges concurrent
//     requests runs fewer batches than requests.
// Exit status 0 unless the export or the op libraries cannot be loaded.

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "tensorflow/cc/saved_model/loader.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor.pb.h"
#include "tensorflow/core/lib/io/record_reader.h"
#include "tensorflow/core/lib/monitoring/collection_registry.h"
#include "tensorflow/core/platform/env.h"

using tensorflow::Status;
using tensorflow::Tensor;

namespace {

// An input of a request besides "text", as the requests file has it: its values stay text until the
// request runs and the signature says what dtype they are.
struct Input {
  std::string name;
  std::vector<std::string> values;  // strings in hex, numbers in decimal (or hex floats)
};

struct Request {
  std::string label, signature;
  Tensor text;                // DT_STRING [batch], fed to the signature's "text" input
  std::vector<Input> inputs;  // the signature's other inputs (the requests file's "inputs" section)
};

[[noreturn]] void Die(const std::string& message) {
  std::cerr << "serving_check: " << message << std::endl;
  std::exit(2);
}

// ------------------------------------------------------------------------------------ formatting

std::string Hex(std::string_view bytes) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) out += {digits[c >> 4], digits[c & 15]};
  return out;
}

std::string Unhex(std::string_view hex) {
  auto nibble = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };  // lowercase, as Python writes it
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out += static_cast<char>(nibble(hex[i]) << 4 | nibble(hex[i + 1]));
  return out;
}

std::string JsonString(std::string_view s) {  // our labels and TF's error messages
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// One output tensor as `"key": [values], "key_shape": [dims]`. Floats are written as their bits so
// the test compares them exactly with the Python session's.
std::string JsonOutput(const std::string& key, const Tensor& t) {
  std::string values;
  for (int64_t i = 0; i < t.NumElements(); ++i) {
    if (i) values += ", ";
    switch (t.dtype()) {
      case tensorflow::DT_STRING:
        values += "\"" + Hex(t.flat<tensorflow::tstring>()(i)) + "\"";
        break;
      case tensorflow::DT_FLOAT: {
        uint32_t bits;
        float f = t.flat<float>()(i);
        std::memcpy(&bits, &f, sizeof bits);
        char buf[16];
        std::snprintf(buf, sizeof buf, "\"%08x\"", bits);
        values += buf;
        break;
      }
      case tensorflow::DT_INT32:
        values += std::to_string(t.flat<int32_t>()(i));
        break;
      case tensorflow::DT_INT64:
        values += std::to_string(t.flat<int64_t>()(i));
        break;
      case tensorflow::DT_BOOL:
        values += t.flat<bool>()(i) ? "true" : "false";
        break;
      default:
        values += "null";
    }
  }
  std::string shape;
  for (int d = 0; d < t.dims(); ++d) shape += (d ? ", " : "") + std::to_string(t.dim_size(d));
  return JsonString(key) + ": [" + values + "], " + JsonString(key + "_shape") + ": [" + shape + "]";
}

// ------------------------------------------------------------------------------------- requests

Tensor Texts(const std::vector<std::string>& texts) {
  Tensor t(tensorflow::DT_STRING, tensorflow::TensorShape({static_cast<int64_t>(texts.size())}));
  for (size_t i = 0; i < texts.size(); ++i) t.flat<tensorflow::tstring>()(i) = texts[i];
  return t;
}

std::vector<std::string> Fields(const std::string& line) {
  std::istringstream stream(line);
  std::vector<std::string> fields;
  for (std::string field; stream >> field;) fields.push_back(field);
  return fields;
}

size_t Count(const std::string& field, const std::string& line) {
  char* end;
  errno = 0;
  unsigned long long n = std::strtoull(field.c_str(), &end, 10);
  if (field.empty() || *end || errno || field[0] == '-') Die("bad count in line \"" + line + "\"");
  return static_cast<size_t>(n);
}

// A request is a header "LABEL SIGNATURE N" (3 fields), N text lines, then optionally "inputs K"
// (2 fields, so never taken for the next header) and K blocks "NAME N" + N value lines.
// Blank lines between requests are skipped (text and value lines may be blank: "" is 0 hex digits).
std::vector<Request> ReadRequests(const std::string& path) {
  std::ifstream in(path);
  if (!in) Die("cannot read " + path);
  std::vector<Request> requests;
  std::string line;
  auto next_line = [&](const std::string& label) -> const std::string& {
    if (!std::getline(in, line)) Die("truncated request " + label);
    return line;
  };
  bool more = static_cast<bool>(std::getline(in, line));
  while (more) {
    std::vector<std::string> header = Fields(line);
    if (header.empty()) {
      more = static_cast<bool>(std::getline(in, line));
      continue;
    }
    if (header.size() != 3) Die("bad request header \"" + line + "\"");
    Request request{header[0], header[1], Tensor(), {}};
    std::vector<std::string> texts(Count(header[2], line));
    for (auto& text : texts) text = Unhex(next_line(request.label));
    request.text = Texts(texts);
    more = static_cast<bool>(std::getline(in, line));
    std::vector<std::string> fields = more ? Fields(line) : std::vector<std::string>();
    if (fields.size() == 2 && fields[0] == "inputs") {
      size_t k = Count(fields[1], line);
      for (size_t j = 0; j < k; ++j) {
        std::vector<std::string> spec = Fields(next_line(request.label));
        if (spec.size() != 2) Die("bad input header \"" + line + "\" in request " + request.label);
        Input input{spec[0], std::vector<std::string>(Count(spec[1], line))};
        for (auto& value : input.values) value = next_line(request.label);
        request.inputs.push_back(std::move(input));
      }
      more = static_cast<bool>(std::getline(in, line));
    }
    requests.push_back(std::move(request));
  }
  return requests;
}

bool ParseInt(const std::string& s, int64_t low, int64_t high, int64_t* value) {
  char* end;
  errno = 0;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end || errno || v < low || v > high) return false;
  *value = v;
  return true;
}

// The values of `input` as a [N] tensor of `dtype`, the dtype the signature declares for it; an error
// message if they are not of it. A float is read as a double and then rounded to float, as numpy
// converts the Python session's feeds (a decimal rounded straight to float may differ in the last bit).
std::string TypedInput(const Input& input, tensorflow::DataType dtype, Tensor* tensor) {
  const int64_t n = static_cast<int64_t>(input.values.size());
  auto bad = [&](int64_t i) {
    return "input " + input.name + ": value " + std::to_string(i) + " (\"" + input.values[i] + "\") is not of dtype " +
           tensorflow::DataTypeString(dtype);
  };
  switch (dtype) {
    case tensorflow::DT_STRING: {
      *tensor = Tensor(dtype, tensorflow::TensorShape({n}));
      for (int64_t i = 0; i < n; ++i) tensor->flat<tensorflow::tstring>()(i) = Unhex(input.values[i]);
      return "";
    }
    case tensorflow::DT_INT32:
    case tensorflow::DT_INT64: {
      *tensor = Tensor(dtype, tensorflow::TensorShape({n}));
      const bool is32 = dtype == tensorflow::DT_INT32;
      for (int64_t i = 0; i < n; ++i) {
        int64_t v;
        if (!ParseInt(input.values[i], is32 ? INT32_MIN : INT64_MIN, is32 ? INT32_MAX : INT64_MAX, &v)) return bad(i);
        if (is32) tensor->flat<int32_t>()(i) = static_cast<int32_t>(v);
        else tensor->flat<int64_t>()(i) = v;
      }
      return "";
    }
    case tensorflow::DT_FLOAT: {
      *tensor = Tensor(dtype, tensorflow::TensorShape({n}));
      for (int64_t i = 0; i < n; ++i) {
        const std::string& s = input.values[i];
        char* end;
        double v = std::strtod(s.c_str(), &end);
        if (s.empty() || *end) return bad(i);
        tensor->flat<float>()(i) = static_cast<float>(v);
      }
      return "";
    }
    default:
      return "input " + input.name + ": serving_check does not feed " + tensorflow::DataTypeString(dtype);
  }
}

// Warm-up records. TF Serving reads assets.extra/tf_serving_warmup_requests as a TFRecord file of
// tensorflow.serving.PredictionLog protos. Their C++ classes are not in the TensorFlow headers, so
// the few fields it needs are read straight from the protobuf wire format (field numbers from
// tensorflow_serving/apis/{prediction_log,predict,model}.proto; the test checks them against the
// installed protos):
//   PredictionLog.predict_log = 6 -> PredictLog.request = 1 -> PredictRequest.model_spec = 1
//   (ModelSpec.signature_name = 3) and PredictRequest.inputs = 2 (map entries: key = 1, value = 2,
//   a tensorflow.TensorProto, which is in the headers).
class WireReader {  // the fields of one serialized message, in order
 public:
  explicit WireReader(std::string_view data) : data_(data) {}
  // The next field's number and, if it is length-delimited (wire type 2: a string or a nested
  // message), its bytes; numeric fields give no bytes (none of the fields read here is numeric).
  bool Next(uint32_t* number, std::string_view* bytes) {
    if (data_.empty()) return false;
    uint64_t tag = Varint(), length = 0;
    *number = static_cast<uint32_t>(tag >> 3);
    switch (tag & 7) {
      case 0: Varint(); break;
      case 1: length = 8; break;
      case 2: length = Varint(); break;
      case 5: length = 4; break;
      default: throw std::runtime_error("unsupported wire type");
    }
    if (length > data_.size()) throw std::runtime_error("truncated field");
    *bytes = (tag & 7) == 2 ? data_.substr(0, length) : std::string_view();
    data_.remove_prefix(length);
    return true;
  }

 private:
  uint64_t Varint() {
    uint64_t value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (data_.empty()) break;
      unsigned char byte = data_.front();
      data_.remove_prefix(1);
      value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if (!(byte & 0x80)) return value;
    }
    throw std::runtime_error("bad varint");
  }
  std::string_view data_;
};

Request ParseWarmupRecord(std::string_view record, const std::string& label) {
  Request request{label, "serving_default", Tensor()};  // TF Serving's default signature name
  bool found = false;
  uint32_t f1, f2, f3, f4;
  std::string_view v1, v2, v3, v4;
  for (WireReader log(record); log.Next(&f1, &v1);) {
    if (f1 != 6) continue;  // predict_log
    for (WireReader predict_log(v1); predict_log.Next(&f2, &v2);) {
      if (f2 != 1) continue;  // request
      found = true;
      for (WireReader predict_request(v2); predict_request.Next(&f3, &v3);) {
        if (f3 == 1) {  // model_spec
          for (WireReader spec(v3); spec.Next(&f4, &v4);)
            if (f4 == 3) request.signature = std::string(v4);  // signature_name
        } else if (f3 == 2) {  // inputs: one map entry
          std::string_view key, value;
          for (WireReader entry(v3); entry.Next(&f4, &v4);) (f4 == 1 ? key : value) = v4;
          tensorflow::TensorProto proto;
          if (key != "text") throw std::runtime_error("unexpected input " + std::string(key));
          if (!proto.ParseFromArray(value.data(), static_cast<int>(value.size())) || !request.text.FromProto(proto))
            throw std::runtime_error("bad TensorProto for input text");
        }
      }
    }
  }
  if (!found) throw std::runtime_error("not a PredictionLog with a predict_log request");
  return request;
}

std::vector<Request> ReadWarmupRecords(const std::string& path) {
  std::unique_ptr<tensorflow::RandomAccessFile> file;
  Status s = tensorflow::Env::Default()->NewRandomAccessFile(path, &file);
  if (!s.ok()) Die(s.ToString());
  tensorflow::io::RecordReader reader(file.get());  // TFRecord framing, CRCs checked
  std::vector<Request> requests;
  uint64_t offset = 0;
  for (tensorflow::tstring record;;) {
    s = reader.ReadRecord(&offset, &record);
    if (absl::IsOutOfRange(s)) break;  // end of file
    if (!s.ok()) Die(path + ": " + s.ToString());
    std::string label = "warmup:" + std::to_string(requests.size());
    try {
      requests.push_back(ParseWarmupRecord(std::string_view(record.data(), record.size()), label));
    } catch (const std::exception& e) {
      Die(path + ", " + label + ": " + e.what());
    }
  }
  return requests;
}

// ------------------------------------------------------------------------------------ serving

// One request through Session::Run, as TF Serving's Predict does: feed the signature's "text" input and
// the request's other inputs, fetch all its outputs. Returns the outputs as JSON members (or an "error"
// member); thread-safe.
std::string Run(const tensorflow::SavedModelBundle& bundle, const Request& request) {
  const auto& signatures = bundle.meta_graph_def.signature_def();
  auto it = signatures.find(request.signature);
  if (it == signatures.end()) return "\"error\": " + JsonString("no signature " + request.signature);
  auto input = it->second.inputs().find("text");
  if (input == it->second.inputs().end()) return "\"error\": \"the signature has no text input\"";
  std::vector<std::pair<std::string, Tensor>> feeds = {{input->second.name(), request.text}};
  for (const auto& extra : request.inputs) {
    if (extra.name == "text") return "\"error\": \"text is fed from the request's texts, not from its inputs\"";
    auto info = it->second.inputs().find(extra.name);
    if (info == it->second.inputs().end())
      return "\"error\": " + JsonString("the signature has no input " + extra.name);
    Tensor tensor;
    std::string error = TypedInput(extra, info->second.dtype(), &tensor);
    if (!error.empty()) return "\"error\": " + JsonString(error);
    feeds.emplace_back(info->second.name(), std::move(tensor));
  }
  std::vector<std::string> keys, names;
  for (const auto& [key, info] : it->second.outputs()) keys.push_back(key);
  std::sort(keys.begin(), keys.end());  // a protobuf map has no order
  for (const auto& key : keys) names.push_back(it->second.outputs().at(key).name());
  std::vector<Tensor> outputs;
  Status s = bundle.session->Run(feeds, names, {}, &outputs);
  if (!s.ok()) return "\"error\": " + JsonString(s.ToString());
  std::string json;
  for (size_t i = 0; i < keys.size(); ++i) json += (i ? ", " : "") + JsonOutput(keys[i], outputs[i]);
  return json;
}

void Print(const Request& request, const std::string& result) {
  std::cout << "{\"label\": " << JsonString(request.label) << ", \"signature\": " << JsonString(request.signature)
            << ", " << result << "}\n";
}

bool IsError(const std::string& result) { return result.rfind("\"error\"", 0) == 0; }

std::string JsonLabels(const std::vector<std::string>& labels) {
  std::string out = "[";
  for (size_t i = 0; i < labels.size(); ++i) out += (i ? ", " : "") + JsonString(labels[i]);
  return out + "]";
}

// {batch size: batches run} over every BatchFunction op of this process so far, from TensorFlow's
// metric of processed batch sizes (a Counter labelled model_name, op_name, batch_size).
std::map<std::string, int64_t> ProcessedBatches() {
  using tensorflow::monitoring::CollectionRegistry;
  std::map<std::string, int64_t> batches;
  auto collected = CollectionRegistry::Default()->CollectMetrics(CollectionRegistry::CollectMetricsOptions());
  auto it = collected->point_set_map.find("/tensorflow/serving/batching/processed_batch_size_v2");
  if (it == collected->point_set_map.end()) return batches;
  for (const auto& point : it->second->points)
    for (const auto& label : point->labels)
      if (label.name == "batch_size") batches[label.value] += point->int64_value;
  return batches;
}

// TF Serving's request threads share one session; Session::Run is thread-safe. Each answer must
// equal the one the same request got alone (no state leaks between concurrent runs).
void RunConcurrently(const tensorflow::SavedModelBundle& bundle, const std::vector<Request>& requests,
                     const std::vector<std::string>& sequential, int threads) {
  std::vector<std::string> concurrent(requests.size());
  std::map<std::string, int64_t> before = ProcessedBatches();
  auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (size_t i = t; i < requests.size(); i += threads) concurrent[i] = Run(bundle, requests[i]);
    });
  for (auto& thread : pool) thread.join();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::string batches;
  for (const auto& [size, count] : ProcessedBatches()) {
    int64_t ran = count - (before.count(size) ? before[size] : 0);
    if (ran > 0) batches += (batches.empty() ? "" : ", ") + JsonString(size) + ": " + std::to_string(ran);
  }
  std::vector<std::string> mismatches, errors;
  for (size_t i = 0; i < requests.size(); ++i) {
    Request labelled = requests[i];
    labelled.label = "concurrent:" + requests[i].label;
    Print(labelled, concurrent[i]);
    if (IsError(concurrent[i])) errors.push_back(requests[i].label + ": " + concurrent[i]);
    else if (concurrent[i] != sequential[i]) mismatches.push_back(requests[i].label);
  }
  std::cout << "{\"concurrent\": {\"threads\": " << threads << ", \"requests\": " << requests.size()
            << ", \"mismatches\": " << JsonLabels(mismatches) << ", \"errors\": " << JsonLabels(errors)
            << ", \"seconds\": " << seconds << ", \"batches\": {" << batches << "}}}\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) Die("usage: serving_check EXPORT_DIR TF_TEXT_OPS_DIR [--requests FILE] [--warmup] [--threads N]");
  const std::string export_dir = argv[1], ops_dir = argv[2];
  std::string requests_file;
  bool warmup = false;
  int threads = 0;
  for (int i = 3; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--requests" && i + 1 < argc) requests_file = argv[++i];
    else if (arg == "--warmup") warmup = true;
    else if (arg == "--threads" && i + 1 < argc) threads = std::stoi(argv[++i]);
    else Die("unknown argument " + arg);
  }

  // tensorflow-text's ops (SentencepieceOp, ...) live in the wheel's shared objects; the model server
  // links them in. Loading them registers their ops and kernels; without them the graph does not load
  // ("Op type not registered 'SentencepieceOp'").
  for (const auto& entry : std::filesystem::directory_iterator(ops_dir)) {
    if (entry.path().extension() != ".so") continue;
    void* handle;
    Status s = tensorflow::Env::Default()->LoadDynamicLibrary(entry.path().c_str(), &handle);
    if (!s.ok()) Die("cannot load " + entry.path().string() + ": " + s.ToString());
  }

  // What TF Serving does for a version directory: the "serve" MetaGraph into one session, default
  // session options (the model server's defaults: thread pools sized to the machine).
  tensorflow::SavedModelBundle bundle;
  Status s = tensorflow::LoadSavedModel(tensorflow::SessionOptions(), tensorflow::RunOptions(), export_dir,
                                        {"serve"}, &bundle);
  if (!s.ok()) Die("LoadSavedModel: " + s.ToString());

  if (warmup) {
    for (const auto& request : ReadWarmupRecords(export_dir + "/assets.extra/tf_serving_warmup_requests"))
      Print(request, Run(bundle, request));
  }
  if (requests_file.empty()) return 0;
  std::vector<Request> requests = ReadRequests(requests_file);
  std::vector<std::string> sequential;
  for (const auto& request : requests) {
    sequential.push_back(Run(bundle, request));
    Print(request, sequential.back());
  }
  if (threads > 0) RunConcurrently(bundle, requests, sequential, threads);
  return 0;
}
