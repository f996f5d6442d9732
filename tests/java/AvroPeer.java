import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ArrayNode;
import com.fasterxml.jackson.databind.node.JsonNodeFactory;
import com.fasterxml.jackson.databind.node.ObjectNode;
import java.io.File;
import java.nio.ByteBuffer;
import java.util.ArrayList;
import java.util.HexFormat;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.apache.avro.Schema;
import org.apache.avro.SchemaNormalization;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericFixed;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.message.BinaryMessageDecoder;
import org.apache.avro.message.MissingSchemaException;

/**
 * An Avro peer nobody on rollout-journal wrote: Apache Avro Java decodes journal
 * records with its own single-object decoder.
 *
 * <p>Input (a JSON file named by the only argument): {"schemas": [{"id", "json"}, ...]
 * oldest version first per record, "messages": [hex of one record, ...]}. Each schema
 * is parsed alone from its self-contained JSON. Per record type the newest version is
 * the reader; every version is registered with a {@link BinaryMessageDecoder}, which
 * finds the writer by the fingerprint after C3 01, exactly as a Java consumer would.
 *
 * <p>Output (stdout, JSON): {"fingerprints": {id: SchemaNormalization.parsingFingerprint64},
 * "messages": [{"schema": full name, "value": ...} or {"error": ...}]}; bytes are hex.
 */
public final class AvroPeer {
  private static final JsonNodeFactory NODES = JsonNodeFactory.instance;
  private static final HexFormat HEX = HexFormat.of();

  public static void main(String[] args) throws Exception {
    ObjectMapper mapper = new ObjectMapper();
    JsonNode input = mapper.readTree(new File(args[0]));
    ObjectNode out = NODES.objectNode();
    ObjectNode fingerprints = out.putObject("fingerprints");
    Map<String, List<Schema>> versions = new LinkedHashMap<>();
    for (JsonNode entry : input.get("schemas")) {
      Schema schema = new Schema.Parser().parse(entry.get("json").asText()); // one parser each: no shared names
      fingerprints.put(entry.get("id").asText(), SchemaNormalization.parsingFingerprint64(schema));
      versions.computeIfAbsent(schema.getFullName(), name -> new ArrayList<>()).add(schema);
    }
    List<BinaryMessageDecoder<GenericRecord>> decoders = new ArrayList<>();
    for (List<Schema> kept : versions.values()) {
      BinaryMessageDecoder<GenericRecord> decoder =
          new BinaryMessageDecoder<>(GenericData.get(), kept.get(kept.size() - 1));
      kept.forEach(decoder::addSchema);
      decoders.add(decoder);
    }
    ArrayNode results = out.putArray("messages");
    for (JsonNode message : input.get("messages")) {
      results.add(decode(decoders, HEX.parseHex(message.asText())));
    }
    mapper.writeValue(System.out, out);
  }

  private static ObjectNode decode(List<BinaryMessageDecoder<GenericRecord>> decoders, byte[] bytes) {
    ObjectNode result = NODES.objectNode();
    for (BinaryMessageDecoder<GenericRecord> decoder : decoders) {
      try {
        GenericRecord record = decoder.decode(bytes);
        result.put("schema", record.getSchema().getFullName());
        result.set("value", toJson(record, record.getSchema()));
        return result;
      } catch (MissingSchemaException notThisRecordType) {
        // each decoder knows one record type's versions; ask the next
      } catch (Exception exc) {
        return result.put("error", exc.toString());
      }
    }
    return result.put("error", "no registered schema has this record's fingerprint");
  }

  private static JsonNode toJson(Object value, Schema schema) {
    switch (schema.getType()) {
      case RECORD: {
        ObjectNode node = NODES.objectNode();
        GenericRecord record = (GenericRecord) value;
        for (Schema.Field field : schema.getFields()) {
          node.set(field.name(), toJson(record.get(field.pos()), field.schema()));
        }
        return node;
      }
      case UNION:
        return toJson(value, schema.getTypes().get(GenericData.get().resolveUnion(schema, value)));
      case ARRAY: {
        ArrayNode node = NODES.arrayNode();
        for (Object item : (List<?>) value) {
          node.add(toJson(item, schema.getElementType()));
        }
        return node;
      }
      case MAP: {
        ObjectNode node = NODES.objectNode();
        for (Map.Entry<?, ?> entry : ((Map<?, ?>) value).entrySet()) {
          node.set(entry.getKey().toString(), toJson(entry.getValue(), schema.getValueType()));
        }
        return node;
      }
      case BYTES: {
        ByteBuffer buffer = ((ByteBuffer) value).duplicate();
        byte[] bytes = new byte[buffer.remaining()];
        buffer.get(bytes);
        return NODES.textNode(HEX.formatHex(bytes));
      }
      case FIXED:
        return NODES.textNode(HEX.formatHex(((GenericFixed) value).bytes()));
      case STRING:
      case ENUM:
        return NODES.textNode(value.toString());
      case INT:
        return NODES.numberNode((Integer) value);
      case LONG:
        return NODES.numberNode((Long) value);
      case FLOAT:
        return NODES.numberNode((Float) value);
      case DOUBLE:
        return NODES.numberNode((Double) value);
      case BOOLEAN:
        return NODES.booleanNode((Boolean) value);
      case NULL:
        return NODES.nullNode();
      default:
        throw new IllegalArgumentException("unexpected Avro type " + schema.getType());
    }
  }
}
